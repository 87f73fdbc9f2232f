"""Teach a model its adaptive tokens.

Two modes, one example builder and one loss:
  * ``adapter`` (default): the base model is frozen; only the SAT embeddings and the SAT-only
    low-rank updates train. Targets are the base model's own next-token choice at the standard
    position each SAT stands for (distillation), since that is what verification accepts. Standard
    tokens cannot change, so they run once without gradients and fill a KV cache; the SATs then run
    against that cache with a 4-D mask, and backpropagation touches the SAT rows only.
  * ``paper``: the model itself is fine-tuned (fully, or LoRA through peft) with the ordinary
    next-token loss on standard tokens plus the SAT loss against the true tokens; SATs are a
    vocabulary row. One forward pass over standard tokens and SATs with the 4-D mask.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache

from ..models import DEFAULT_MODEL, LoadConfig, load_model
from ..sat import SPEC_FILE, AdapterConfig, SatAdapter, SatModel, SatSpec
from .data import (Corpus, HumanEvalFilter, WindowSampler, chat_instructions, code_documents, function_prompts,
                   self_distill, stdlib_files)
from ..layout import SatLayout
from .corpus import MODE_NAMES as CORPUS_MODES, load_shards
from .examples import sample_layout
from .report import record_figure

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Everything a training run needs; `python -m sdsat.train` fills it from flags."""

    mode: str = "adapter"  # "adapter" (frozen base, lossless) or "paper" (fine-tune the model)
    model: str = DEFAULT_MODEL  # the embedded default, a hub id or a local folder
    out: str = "runs/sat-smollm2-c"  # run folder: corpus, checkpoint, record, adapter
    num_sats: int = 5  # SATs trained = largest k the decoder may use
    rank: int = 16  # adapter: LoRA rank of the SAT-only updates (0: embeddings only)
    alpha: float = 32.0  # adapter: LoRA scale numerator
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"])
    layers: list[int] | None = None  # adapter: decoder layers with updates; None for inject_layer and above
    inject_layer: int = 10  # adapter: SAT embeddings enter this decoder layer; backprop stops there (0: input)
    per_position: bool = False  # adapter: each SAT position gets LoRA updates of its own (num_sats times the room)
    mlp_width: int = 0  # adapter: extra MLP neurons per adapted layer that only SAT rows use (0: none)
    sat_token: str = "<empty_output>"  # paper: the vocabulary token used as SAT (also the adapter's init)
    paper_lora_rank: int = 0  # paper: 0 fine-tunes every weight, > 0 trains LoRA (peft) of this rank
    target: str = "argmax"  # adapter: match the base model's "argmax" or its full "distribution"
    dtype: str = "bfloat16"  # compute precision: "bfloat16" (autocast; what trains stays float32) or "float32"
    offset_decay: float = 0.8  # loss weight of SAT j is decay ** j: near drafts matter most
    latent_weight: float = 0.0  # adapter: weight of the latent consistency term (0: none)
    on_policy_weight: float = 0.0  # adapter: extra weight on SATs greedy decoding reaches whose draft misses
    steps: int = 900  # optimizer steps
    batch_size: int = 2  # sequences per step
    seq_len: int = 256  # standard tokens per sequence
    runs_per_seq: int = 40  # SAT runs inserted per sequence
    lr: float = 3e-3  # peak learning rate
    lr_schedule: str = "cosine"  # after warm-up: "cosine" decay to 0 at `steps`, or "constant" (a run stopped
    # at step n then equals a run of n steps, so one run gives a learning curve)
    embedding_lr_scale: float = 30.0  # adapter: SAT embeddings injected above layer 0 learn this much faster,
    # since they must stand out against a residual stream far larger than a fresh parameter
    warmup: int = 10  # warm-up steps
    seed: int = 0  # seeds data, layouts and initialisation
    code_files: int = 300  # standard-library files for the raw-code source
    code_prompts: int = 768  # function signatures + docstrings for self-distillation
    chat_prompts: int = 340  # chat instructions for self-distillation
    distill_tokens: int = 192  # new tokens per self-distilled completion
    distill_batch: int = 48  # completions generated at once
    corpus: str = ""  # a folder of `python -m sdsat.train.corpus`: its completions replace the built-in ones
    corpus_modes: list[str] = field(default_factory=lambda: list(CORPUS_MODES))  # which of its decodings to use
    init_from: str = ""  # adapter: start from this trained adapter's weights (fresh optimizer and schedule)
    weights: dict[str, float] = field(default_factory=lambda: {"code": 0.1, "code_completions": 0.45,
                                                               "chat_completions": 0.45})
    held_out: int = 8  # sequences per source kept for evaluation
    eval_every: int = 125  # steps between acceptance evaluations
    checkpoint_every: int = 25  # steps between checkpoints
    save_at: list[int] = field(default_factory=list)  # steps whose SATs are also saved, as sats-step<N>/ (curves)

    def validate(self) -> None:
        """Every setting by type and range, as the decoder's are; raises ValueError naming the first bad one."""
        for name, choices in (("mode", ("adapter", "paper")), ("target", ("argmax", "distribution")),
                              ("dtype", ("bfloat16", "float32")),
                              ("lr_schedule", ("cosine", "constant"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        for name in ("model", "out", "sat_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name, low in _WHOLE_AT_LEAST.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")
        for name, (low, high) in _REAL_IN.items():  # (low, high]: above low, at most high
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
                raise ValueError(f"{name} must be a number in ({low}, {high}], got {value!r}")
        if self.seq_len < self.num_sats + 3:
            raise ValueError(f"seq_len must be at least num_sats + 3 = {self.num_sats + 3}, got {self.seq_len}")
        if (not isinstance(self.target_modules, list) or not self.target_modules
                or not all(isinstance(m, str) and m for m in self.target_modules)):
            raise ValueError(f"target_modules must be a non-empty list of module names, got {self.target_modules!r}")
        if not isinstance(self.save_at, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= self.steps for i in self.save_at):
            raise ValueError(f"save_at must be a list of steps from 1 to steps = {self.steps}, got {self.save_at!r}")
        if (not isinstance(self.corpus_modes, list) or not self.corpus_modes
                or not set(self.corpus_modes) <= set(CORPUS_MODES)):
            raise ValueError(f"corpus_modes must be a non-empty list of {', '.join(CORPUS_MODES)}; "
                             f"got {self.corpus_modes!r}")
        if not self.corpus and sorted(self.corpus_modes) != sorted(CORPUS_MODES):
            raise ValueError("corpus_modes picks decodings of --corpus; name a corpus folder, or leave it out")
        if not isinstance(self.init_from, str) or (self.init_from and (
                self.mode != "adapter" or not (Path(self.init_from) / "adapter_config.json").is_file())):
            raise ValueError("init_from must be a folder holding a trained adapter (adapter_config.json), for mode "
                             f"adapter only; got {self.init_from!r}")
        if not isinstance(self.per_position, bool):
            raise ValueError(f"per_position must be true or false, got {self.per_position!r}")
        if self.per_position and (self.mode != "adapter" or self.rank == 0 or self.num_sats == 1):
            raise ValueError("per_position needs mode adapter, a rank of 1 or more and num_sats of 2 or more "
                             "(it splits the adapter's low-rank updates between SAT positions)")
        for name in ("latent_weight", "on_policy_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
                raise ValueError(f"{name} must be a number from 0 to 100, got {value!r}")
            if value and self.mode != "adapter":
                raise ValueError(f"{name} needs mode adapter (it shapes the frozen model's SAT rows); got mode "
                                 f"{self.mode!r}")
        if self.mlp_width and self.mode != "adapter":
            raise ValueError("mlp_width needs mode adapter (it adds MLP neurons that only SAT rows use); got mode "
                             f"{self.mode!r}")
        if self.layers is not None and (not isinstance(self.layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers)):
            raise ValueError(f"layers must be a list of decoder layer numbers (0 or more), got {self.layers!r}")
        weights = self.weights
        if (not isinstance(weights, dict) or not weights or not all(isinstance(k, str) for k in weights)
                or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                           for w in weights.values()) or not sum(weights.values()) > 0):
            raise ValueError('weights must map source names to numbers of 0 or more, not all 0, as JSON '
                             f'(e.g. {{"code": 0.1, "chat_completions": 0.9}}); got {weights!r}')


# The whole-number settings and their least values: 0 would divide by zero (warmup, eval_every,
# checkpoint_every) or train nothing.
_WHOLE_AT_LEAST = {"num_sats": 1, "rank": 0, "mlp_width": 0, "inject_layer": 0, "paper_lora_rank": 0, "steps": 1,
                   "batch_size": 1, "seq_len": 1, "runs_per_seq": 1, "warmup": 1, "seed": 0, "code_files": 0,
                   "code_prompts": 0, "chat_prompts": 0, "distill_tokens": 1, "distill_batch": 1, "held_out": 0,
                   "eval_every": 1, "checkpoint_every": 1}
# The real-valued settings: (low, high], so NaN, 0 and inf are refused where they would poison training.
_REAL_IN = {"alpha": (0.0, 1e6), "offset_decay": (0.0, 1.0), "lr": (0.0, 10.0), "embedding_lr_scale": (0.0, 1e6)}


# -- corpus -----------------------------------------------------------------------------------------

def build_corpus(config: TrainConfig, model, tokenizer) -> Corpus:
    """The three offline sources, as token ids (see data.py); cached in the run folder."""
    path = Path(config.out) / "corpus.json"
    if path.is_file() and not config.corpus:
        return Corpus.load(path)
    rng = random.Random(config.seed)
    keep = HumanEvalFilter()
    docs = code_documents(stdlib_files(config.code_files, rng), keep)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    sources = {"code": [encode(d) for d in docs]}
    if config.corpus:  # completions built at scale, in the background (corpus.py): nothing to distill here
        built = load_shards(Path(config.corpus))
        if not built:
            raise ValueError(f"corpus {config.corpus!r} has no shards yet: build some with "
                             "python -m sdsat.train.corpus")
        for name, chat in (("code_completions", False), ("chat_completions", True)):
            sources[name] = [seq["ids"] for seq in built if seq["chat"] == chat and seq["mode"] in config.corpus_modes]
        return Corpus(sources)
    prompts = function_prompts(docs, keep, config.code_prompts, rng)
    sources["code_completions"] = self_distill(model, tokenizer, prompts, False, config.distill_tokens,
                                               config.distill_batch, keep, "distilling code")
    instructions = chat_instructions(config.chat_prompts, rng)
    sources["chat_completions"] = self_distill(model, tokenizer, instructions, True, config.distill_tokens,
                                               config.distill_batch, keep, "distilling chat")
    corpus = Corpus(sources)
    corpus.save(path)
    return corpus


# -- the SAT forward pass and loss ------------------------------------------------------------------

def sat_logits(sat_model: SatModel, ids: torch.Tensor, layout: SatLayout, keep_standard: torch.Tensor | None,
               frozen_base: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at chosen standard positions (B, S, V) and at every SAT (B, M, V).

    frozen_base: standard tokens run first without gradients into a cache, then the SATs run
    against it (the adapter's cheap path). Otherwise one pass over both, with gradients everywhere.
    """
    b, n = ids.shape
    keep_standard = (keep_standard if keep_standard is not None else torch.arange(n)).to(ids.device)
    if frozen_base:
        return _frozen_base_passes(sat_model, ids, layout, sat_model.forward, logits_to_keep=keep_standard)
    mask, positions, slots = _block(layout, ids)
    full = torch.cat([ids, torch.zeros(b, layout.num_sats, dtype=ids.dtype, device=ids.device)], 1)
    keep = torch.cat([keep_standard, n + torch.arange(layout.num_sats, device=ids.device)])
    logits = sat_model.forward(full, slots, attention_mask=mask, position_ids=positions, logits_to_keep=keep)
    return logits[:, :len(keep_standard)], logits[:, len(keep_standard):]


_NOT_PLAIN_HEAD = ("latent_weight needs a model whose logits are its head applied to the final hidden state (a "
                   "Llama, Mistral, Qwen or Phi-3 family model)")


def sat_states(sat_model: SatModel, ids: torch.Tensor, layout: SatLayout,
               keep_standard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at chosen standard positions (B, S, H), without gradients, and at every SAT (B, M, H):
    the frozen-base path of `sat_logits` one step short of the head (`SatModel.head` turns either into logits)."""
    if not sat_model.plain_head:
        raise ValueError(_NOT_PLAIN_HEAD)
    standard, sats = _frozen_base_passes(sat_model, ids, layout, sat_model.hidden_states)
    return standard[:, keep_standard.to(ids.device)], sats


def _block(layout: SatLayout, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout's 4-D mask, positions (B, T) and SAT slots (B, T) for a batch of ids."""
    b = ids.shape[0]
    return (layout.attention_mask().to(ids.device), layout.position_ids.to(ids.device).expand(b, -1),
            layout.sat_slots.to(ids.device).expand(b, -1))


def _frozen_base_passes(sat_model: SatModel, ids: torch.Tensor, layout: SatLayout, run: Callable[..., torch.Tensor],
                        **standard_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard tokens through `run` without gradients into a cache, then the SATs against it."""
    b, n = ids.shape
    mask, positions, slots = _block(layout, ids)
    cache = DynamicCache(config=sat_model.model.config)
    with torch.no_grad():
        standard = run(ids, cache=cache, attention_mask=mask[..., :n, :n], position_ids=positions[:, :n],
                       **standard_kwargs)
    sats = run(torch.zeros(b, layout.num_sats, dtype=ids.dtype, device=ids.device), slots[:, n:], cache=cache,
               attention_mask=mask[..., n:, :], position_ids=positions[:, n:])
    return standard, sats


def sat_loss(config: TrainConfig, sat_model: SatModel, ids: torch.Tensor,
             layout: SatLayout) -> tuple[torch.Tensor, list[float]]:
    """Weighted SAT loss (plus the LM loss in paper mode) and the SAT loss per offset j."""
    targets = layout.target_positions.to(ids.device)  # (M,) standard position p+1+j for each SAT
    slot = layout.slot.to(ids.device)
    weights = (config.offset_decay ** slot.float()).expand(ids.shape[0], -1)  # (B, M)
    extra = None
    if config.mode == "adapter":
        if config.latent_weight:
            standard_state, sat_state = sat_states(sat_model, ids, layout, targets)
            with torch.no_grad():
                teacher = sat_model.head(standard_state)
            student = sat_model.head(sat_state)
            # The SAT row learns to be where ordinary decoding would be, not only to put the same token on top.
            extra = relative_distance(sat_state, standard_state)
        else:
            teacher, student = sat_logits(sat_model, ids, layout, targets, frozen_base=True)
        if config.target == "argmax":
            per_sat = F.cross_entropy(student.transpose(1, 2), teacher.argmax(-1), reduction="none")  # (B, M)
        else:
            per_sat = -(teacher.float().softmax(-1) * student.float().log_softmax(-1)).sum(-1)
        if config.on_policy_weight:
            weights = weights * (1 + config.on_policy_weight * reached_misses(student, teacher, layout).float())
        lm_loss = None
    else:
        standard, student = sat_logits(sat_model, ids, layout, None, frozen_base=False)
        per_sat = F.cross_entropy(student.transpose(1, 2), ids[:, targets + 1], reduction="none")
        lm_loss = F.cross_entropy(standard[:, :-1].transpose(1, 2), ids[:, 1:])
    loss = (per_sat * weights).sum() / weights.sum()
    if extra is not None:
        loss = loss + config.latent_weight * (extra * weights).sum() / weights.sum()
    if lm_loss is not None:
        loss = loss + lm_loss
    by_offset = [float(per_sat.detach()[:, slot == j].mean()) if bool((slot == j).any()) else math.nan
                 for j in range(config.num_sats)]
    return loss, by_offset


def relative_distance(state: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """|state - target|² / |target|² over the last dimension, in float32: the latent consistency term's distance."""
    target = target.float()
    return ((state.float() - target) ** 2).sum(-1) / (target ** 2).sum(-1).clamp(min=1e-6)


@torch.no_grad()
def reached_misses(student: torch.Tensor, teacher: torch.Tensor, layout: SatLayout) -> torch.Tensor:
    """(B, M) True where a SAT's first choice misses while every SAT before it in its run hit: the drafts that
    greedy verification tests and rejects, where the drafter's failures cost accepted tokens. (On the base
    model's own greedy text, as the corpus's greedy decodings are, the teacher's choices are that text.)"""
    miss = student.argmax(-1) != teacher.argmax(-1)
    run, slot = layout.run.to(miss.device), layout.slot.to(miss.device)
    earlier = (run[:, None] == run[None, :]) & (slot[None, :] < slot[:, None])  # (M, M): SAT i's run-mates before it
    reached = ~(miss[:, None, :] & earlier).any(-1)
    return reached & miss


@torch.no_grad()
def draft_acceptance(sat_model: SatModel, windows: torch.Tensor, num_sats: int, stride: int = 4) -> list[float]:
    """Teacher-forced acceptance per draft position on held-out windows.

    A run of SATs after every `stride`-th position drafts; draft j counts as accepted when it and
    every draft before it equal the model's own greedy choice, as greedy verification would decide.
    """
    n = windows.shape[1]
    anchors = torch.arange(0, n - num_sats - 2, stride)
    runs = len(anchors)
    layout = SatLayout.runs_at(n, anchors, num_sats)
    targets = layout.target_positions.to(windows.device)
    teacher, student = sat_logits(sat_model, windows, layout, targets, frozen_base=True)
    match = (teacher.argmax(-1) == student.argmax(-1)).view(windows.shape[0], runs, num_sats)
    return match.int().cumprod(-1).float().mean((0, 1)).tolist()


# -- the run ----------------------------------------------------------------------------------------

def prepare(config: TrainConfig, model, tokenizer) -> tuple[SatModel, list[dict]]:
    """The SatModel to train and its trainable parameters, as optimizer groups with an "lr_scale"."""
    init_id = tokenizer.convert_tokens_to_ids(config.sat_token) if config.sat_token in tokenizer.get_vocab() else None
    if config.mode == "adapter":
        adapter_config = AdapterConfig(base_model=config.model,
                                       hidden_size=model.get_input_embeddings().weight.shape[1],
                                       num_layers=model.config.num_hidden_layers, num_sats=config.num_sats,
                                       rank=config.rank, alpha=config.alpha,
                                       target_modules=list(config.target_modules), layers=config.layers,
                                       inject_layer=config.inject_layer, per_position=config.per_position,
                                       mlp_width=config.mlp_width)
        torch.manual_seed(config.seed)
        adapter = SatAdapter.for_model(model, adapter_config, init_token_id=init_id)
        sat_model = SatModel(model, SatSpec(kind="adapter", max_k=config.num_sats), adapter)
        if config.init_from:  # after attach(), which casts to the model's dtype: load at full precision
            warm_start(adapter.float(), Path(config.init_from))
        params = [{"params": [adapter.embeddings],
                   "lr_scale": config.embedding_lr_scale if config.inject_layer > 0 else 1.0},
                  {"params": [*adapter.lora_a.values(), *adapter.lora_b.values(), *adapter.mlp_in.values(),
                              *adapter.mlp_out.values()], "lr_scale": 1.0}]
    else:
        if init_id is None:
            raise ValueError(f"sat_token {config.sat_token!r} is not in the vocabulary; name an existing, unused token")
        if config.paper_lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=config.paper_lora_rank, lora_alpha=2 * config.paper_lora_rank,
                                                     target_modules=list(config.target_modules)))
            model.get_input_embeddings().weight.requires_grad_(True)  # the SAT row must be able to move
        else:
            model.requires_grad_(True)
        sat_model = SatModel(model, SatSpec(kind="vocab", sat_ids=[init_id], max_k=config.num_sats))
        params = [{"params": [p for p in model.parameters() if p.requires_grad], "lr_scale": 1.0}]
    return sat_model, params


def warm_start(adapter: SatAdapter, folder: Path) -> None:
    """Copy a trained adapter's weights into `adapter`, which must have its shape, or a larger LoRA rank at the
    same scale alpha / rank: the trained directions fill the first ranks and the new ones start with B = 0, so
    the run starts from exactly the trained adapter's function with room to grow. Shared updates may also be
    split into one copy per SAT position (`per_position`), the same function again; and SAT-only MLP neurons may be
    added (`mlp_width`) to an adapter without them: their output weights start at 0, so again the same function.
    (A checkpoint resumed later overrides all of it, as it should.)"""
    trained = SatAdapter.load(folder)
    for name in ("hidden_size", "num_layers"):
        if getattr(adapter.config, name) != getattr(trained.config, name):
            raise ValueError(f"init_from {folder}: it was trained for base model {trained.config.base_model!r} "
                             f"({name} {getattr(trained.config, name)}), not this one; pass that --model")
    splits = adapter.config.per_position and not trained.config.per_position  # shared -> one copy per position
    if trained.config.per_position and not adapter.config.per_position:
        raise ValueError(f"init_from {folder}: it has LoRA updates per SAT position; train with --per-position")
    grows = trained.config.rank < adapter.config.rank and trained.config.rank > 0
    if grows and adapter.config.per_position:  # each position's block would move: the copy below is contiguous
        raise ValueError(f"init_from {folder}: the rank can grow for shared updates only, not with --per-position")
    if grows and trained.scale != adapter.scale:
        raise ValueError(f"init_from {folder}: the rank grows from {trained.config.rank} to {adapter.config.rank}, "
                         f"so alpha must grow with it to {trained.scale * adapter.config.rank:g} (alpha / rank stays "
                         f"{trained.scale:g}); got --alpha {adapter.config.alpha:g}")
    if splits:
        trained = _per_position(trained)
    adds_mlp = trained.config.mlp_width == 0  # new neurons keep their initialisation: D = 0 adds nothing
    for name in ("num_sats", "rank", "alpha", "target_modules", "layers", "inject_layer", "mlp_width"):
        mine, theirs = getattr(adapter.config, name), getattr(trained.config, name)
        if (grows and name in ("rank", "alpha")) or (adds_mlp and name == "mlp_width"):
            continue
        if (sorted(mine) != sorted(theirs)) if name == "target_modules" else mine != theirs:
            raise ValueError(f"init_from {folder}: its {name} is {theirs!r}, this run's is {mine!r}; "
                             f"train with --{name.replace('_', '-')} to match")
    ours, theirs = adapter.state_dict(), trained.state_dict()  # ours: views of the adapter's parameters
    width = trained.config.lora_width
    slots = {name: _first_ranks(name, tensor, width) for name, tensor in ours.items()
             if not (adds_mlp and name.startswith("mlp_"))}
    for name, slot in slots.items():
        have = theirs.get(name)
        if have is None or have.shape != slot.shape:
            raise ValueError(f"init_from {folder}: its {name} does not fit this model "
                             f"({tuple(have.shape) if have is not None else 'missing'}, need {tuple(slot.shape)})")
    with torch.no_grad():
        for name, slot in slots.items():
            if name.startswith("lora_b."):
                ours[name].zero_()  # the grown ranks add nothing until trained
            slot.copy_(theirs[name])


def _per_position(shared: SatAdapter) -> SatAdapter:
    """The same function with one copy of the shared LoRA updates per SAT position (each SAT row's own block of
    A's columns and B's rows reproduces the shared update exactly); SAT-only MLP neurons stay shared."""
    config = replace(shared.config, per_position=True)
    split = SatAdapter(config)
    K = config.num_sats
    with torch.no_grad():
        split.embeddings = nn.Parameter(shared.embeddings.detach().clone())
        split.base_embedding.copy_(shared.base_embedding)
        for key in shared.lora_a:
            split.lora_a[key] = nn.Parameter(shared.lora_a[key].detach().repeat(1, K))
            split.lora_b[key] = nn.Parameter(shared.lora_b[key].detach().repeat(K, 1))
        for name in ("mlp_in", "mlp_out"):
            for key, value in getattr(shared, name).items():
                getattr(split, name)[key] = nn.Parameter(value.detach().clone())
    return split


def _first_ranks(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of an adapter tensor that a trained one of LoRA rank `rank` fills: the first ranks of a LoRA
    factor (all of it when the ranks are equal), or the whole tensor."""
    if name.startswith("lora_a."):
        return tensor[:, :rank]
    if name.startswith("lora_b."):
        return tensor[:rank]
    return tensor


def train(config: TrainConfig, model=None, tokenizer=None, corpus: Corpus | None = None, progress: bool = True) -> dict:
    """Train (or resume) and return the training record; saves the adapter or model in `config.out`."""
    config.validate()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        # Training changes weights (paper mode) that routed CPU kernels would hold stale copies of. A frozen
        # base is held in the compute precision (no cast per product); weights that train stay float32.
        dtype = config.dtype if config.mode == "adapter" else "float32"
        model, tokenizer = load_model(LoadConfig(model=config.model, dtype=dtype, cpu_kernels=False))
    corpus = corpus or build_corpus(config, model, tokenizer)
    train_corpus, held_out = (corpus.split_stable(config.held_out) if config.corpus  # it grows between runs
                              else corpus.split(config.held_out, random.Random(config.seed)))
    separator = model.generation_config.eos_token_id
    separator = separator if isinstance(separator, int) else separator[0]
    sampler = WindowSampler(train_corpus, config.weights, config.seq_len, separator, config.seed)
    eval_windows = _eval_windows(held_out, config.seq_len, separator)

    sat_model, params = prepare(config, model, tokenizer)
    if config.latent_weight and not sat_model.plain_head:
        sat_model.adapter.detach()
        raise ValueError(_NOT_PLAIN_HEAD)
    sat_model.model.train(config.mode == "paper")
    if sat_model.adapter is not None:
        sat_model.adapter.float()  # attach() gave it the model's dtype; Adam needs float32 weights
    groups = [dict(group, lr=config.lr * group["lr_scale"]) for group in params]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.0)
    params = [p for group in groups for p in group["params"]]
    def schedule(step: int) -> float:
        decay = 0.5 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))
        return min(1.0, (step + 1) / config.warmup) * (decay if config.lr_schedule == "cosine" else 1.0)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    layouts = torch.Generator().manual_seed(config.seed + 1)
    record = {"config": asdict(config), "steps": [], "evals": []}
    start_step, wall_before = _resume(out, sat_model, params, optimizer, scheduler, sampler, layouts, record)

    try:
        _loop(config, out, sat_model, params, optimizer, scheduler, sampler, layouts, record, eval_windows, start_step,
              wall_before, progress)
        save_trained(sat_model, out / "sats", record)
    finally:
        if sat_model.adapter is not None:
            sat_model.adapter.detach()  # leave the base model as it was given
    return record


def _loop(config, out, sat_model, params, optimizer, scheduler, sampler, layouts, record, eval_windows, start_step,
          wall_before, progress) -> None:
    started = time.perf_counter()
    bar = tqdm(range(start_step, config.steps), initial=start_step, total=config.steps, desc="training SATs",
               disable=not progress)
    for step in bar:
        ids = sampler.batch(config.batch_size).to(sat_model.device)
        layout = sample_layout(config.seq_len, config.runs_per_seq, config.num_sats, layouts)
        with compute_precision(config, sat_model.device):
            loss, by_offset = sat_loss(config, sat_model, ids, layout)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        wall = wall_before + time.perf_counter() - started
        seen = (step + 1 - start_step) * config.batch_size
        record["throughput"] = {"tokens_per_second": round(seen * config.seq_len / (wall - wall_before), 1),
                                "sats_per_second": round(seen * layout.num_sats / (wall - wall_before), 1),
                                "dtype": config.dtype, "device": str(sat_model.device)}  # of this run's part
        record["steps"].append({"step": step + 1, "loss": float(loss.detach()), "loss_by_offset": by_offset,
                                "lr": scheduler.get_last_lr()[0],
                                "tokens_seen": (step + 1) * config.batch_size * config.seq_len,
                                "sats_seen": (step + 1) * config.batch_size * layout.num_sats, "wall_seconds": wall})
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", d1=f"{by_offset[0]:.2f}",
                        tok_s=f"{record['throughput']['tokens_per_second']:.0f}")
        last = step + 1 == config.steps
        if (step + 1) % config.eval_every == 0 or last:
            with compute_precision(config, sat_model.device):
                acceptance = {name: draft_acceptance(sat_model, w.to(sat_model.device), config.num_sats)
                              for name, w in eval_windows.items()}
            record["evals"].append({"step": step + 1, "acceptance_by_position": acceptance, "wall_seconds": wall})
            bar.write(f"step {step + 1}: held-out acceptance by position " +
                      "; ".join(f"{k}: " + " ".join(f"{a:.2f}" for a in v) for k, v in acceptance.items()))
        if step + 1 in config.save_at:
            save_trained(sat_model, out / f"sats-step{step + 1}", record)
        if (step + 1) % config.checkpoint_every == 0 or last:
            _checkpoint(out, sat_model, optimizer, scheduler, sampler, layouts, record, step + 1, wall)


def compute_precision(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Products in bfloat16 where config.dtype asks for it (losses and softmaxes stay float32: autocast)."""
    if config.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def save_trained(sat_model: SatModel, folder: Path, record: dict) -> None:
    """The adapter (or the fine-tuned model) with its SAT spec and training record."""
    folder.mkdir(parents=True, exist_ok=True)
    if sat_model.adapter is not None:
        sat_model.adapter.save(folder, dtype=torch.float16)  # half the size; drafts barely move (tested)
        SatSpec(kind="adapter", max_k=sat_model.max_k, adapter=".").save(folder)
    else:
        model = sat_model.model
        model = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        model.save_pretrained(folder)
        SatSpec(kind="vocab", sat_ids=sat_model.spec.sat_ids, max_k=sat_model.max_k).save(folder)
    (folder / "training_record.json").write_text(json.dumps(record) + "\n")
    try:
        figure = record_figure(record)
    except ImportError:  # no plotly (a lent GPU machine): the record's JSON is all there is
        log.warning("plotly is missing: %s has no training_record.html", folder)
        return
    figure.write_html(folder / "training_record.html", include_plotlyjs="cdn")


def export(source: Path, target: Path) -> None:
    """Copy the trained folder `source` into `target` as one step: the new folder is built in a hidden
    sibling and renamed into place, so a crash never leaves new weights beside an old config. Files of an
    existing `target` that the run does not write (notes such as tuning.json) are carried over."""
    source, target = Path(source), Path(target)
    if not (source / SPEC_FILE).is_file():
        raise ValueError(f"nothing to export: {source} holds no trained SATs ({SPEC_FILE} missing)")
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        ours = {path.name for path in source.iterdir()}
        kept = [path for path in target.iterdir() if path.name not in ours] if target.is_dir() else []
        for path in [*kept, *source.iterdir()]:
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, building / path.name)
        _readable(building)  # mkdtemp (and safetensors) make owner-only files; a served adapter is shared
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            target.rename(old / target.name)
            building.rename(target)
            shutil.rmtree(old)
        else:
            building.rename(target)
    finally:
        shutil.rmtree(building, ignore_errors=True)  # gone already unless something failed


def current_umask() -> int:
    """The process's umask, read without setting it where Linux says it (setting it races other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _readable(folder: Path) -> None:
    """Give `folder` and what it holds the modes a new folder and file would get (the umask's)."""
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _eval_windows(held_out: Corpus, n: int, separator: int, max_windows: int = 16) -> dict[str, torch.Tensor]:
    """Up to `max_windows` N-token windows per source: the start of each held-out sequence that is long
    enough, then windows cut from the shorter ones joined end to end (so short chat answers count too)."""
    windows = {}
    for name, seqs in held_out.sources.items():
        rows = [torch.tensor(s[:n]) for s in seqs if len(s) >= n]
        stream = [t for s in seqs if len(s) < n for t in s + [separator]]
        rows += [torch.tensor(stream[i:i + n]) for i in range(0, len(stream) - n + 1, n)]
        if rows:
            windows[name] = torch.stack(rows[:max_windows])
    return windows


def _checkpoint(out: Path, sat_model, optimizer, scheduler, sampler, layouts, record, step: int, wall: float) -> None:
    state = {"step": step, "wall_seconds": wall, "trainable": _trainable_state(sat_model),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "sampler": sampler.state(),
             "layouts": layouts.get_state(), "record": record}
    tmp = out / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(out / "checkpoint.pt")  # a crash mid-save leaves the previous checkpoint whole
    write_atomically(out / "training_record.json", json.dumps(record) + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: readers see all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _trainable_state(sat_model: SatModel) -> dict[str, torch.Tensor]:
    module = sat_model.adapter if sat_model.adapter is not None else sat_model.model
    return {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad}


def _unresumable(path: Path, err: Exception) -> ValueError:
    # A truncated or foreign file fails in torch (UnpicklingError, RuntimeError, EOFError...), one of
    # another run in the restore (KeyError, shape errors): either way the run cannot go on from it.
    return ValueError(f"checkpoint {path} cannot be resumed ({type(err).__name__}: "
                      f"{' '.join(str(err).split())[:200]}); move it away to start the run over")


def _resume(out: Path, sat_model, params, optimizer, scheduler, sampler, layouts, record) -> tuple[int, float]:
    path = out / "checkpoint.pt"
    if not path.is_file():
        return 0, 0.0
    try:
        # weights_only: a run folder may come from elsewhere, and a full unpickler runs any code in it.
        # Everything _checkpoint saves (tensors, numbers, strings, lists, dicts) loads this way.
        state = torch.load(path, weights_only=True)
        step, wall, previous = int(state["step"]), float(state["wall_seconds"]), state["record"]
        before_config = dict(previous["config"])
    except Exception as err:
        raise _unresumable(path, err) from None
    current = record["config"]
    for name, default in (("init_from", ""), ("corpus_modes", list(CORPUS_MODES)), ("per_position", False),
                          ("mlp_width", 0)):
        before = before_config.get(name, default)
        if sorted(before) != sorted(current[name]) if name == "corpus_modes" else before != current[name]:
            # another start, other text (whose held-out split differs) or other weights: not a continuation
            raise ValueError(f"{out} holds a run with {name} {before!r}; this one has {current[name]!r}: "
                             "use another --out")
    try:
        module = sat_model.adapter if sat_model.adapter is not None else sat_model.model
        named = dict(module.named_parameters())
        with torch.no_grad():
            for key, value in state["trainable"].items():
                named[key].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.set_state(state["sampler"])
        layouts.set_state(state["layouts"])
    except Exception as err:
        raise _unresumable(path, err) from None
    record.update(previous)
    if record["config"] != current:  # resumed with other settings (say, more steps): keep both on record
        record.setdefault("resumes", []).append({"step": step, "previous_config": record["config"]})
        record["config"] = current
    log.info("resumed from %s at step %d", path, step)
    return step, wall
