"""Decoders: vanilla autoregressive decoding and SDSAT's two-step draft-then-verify.

Every decoder is a generator that yields one `StepRecord` per iteration and then one
`GenerationResult`, so the app can stream and the benchmark can drain them alike. The KV cache is a
transformers `DynamicCache` owned by the decoder; `_rollback` is the one place it shrinks.

SDSAT iteration (paper, section 3.3), with `pending` the tokens not yet in the cache:
  1. draft:  feed [pending, SAT x k]. The logits at the last pending token give t, which is what
     vanilla decoding would emit; the logits at SAT j give draft d_{j+1}. Drop the SATs from the cache.
  2. verify: feed [t, d_1..d_k]. Accept the longest prefix of drafts the model agrees with, plus the
     model's own next token (the bonus), which becomes `pending`. Drop the rejected drafts.
Each iteration costs two forward passes and emits 2 + accepted tokens.

A draft tree (`DecodeConfig.tree_candidates`, greedy two_step; `tree.py`) verifies the SATs'
runner-up candidates beside the k top drafts in the same verify pass, and moves the accepted path's
cache rows into place (`_keep_rows`).

The fused scheme (not in the paper; `DecodeConfig.scheme = "fused"`) folds the next draft step into
the verify pass: after one draft pass, every pass verifies k drafts and drafts the next k, emitting
1 + accepted tokens per forward pass. Both schemes are lossless.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

from .layout import SatLayout
from .prompts import StopChecker
from .sampling import SamplingConfig, TokenChooser
from .sat import SatModel
from .tree import MAX_EXTRA as MAX_TREE_CANDIDATES
from .tree import DraftTree

METHODS = ("vanilla", "sdsat")
SCHEMES = ("two_step", "fused")
# Prompt lookup prefers the longest recurring suffix up to this many tokens: a longer match is a more
# specific hint (on HumanEval outputs, offline: 4 → 2 tokens copied 2.42 vs 2.37 tokens per pass).
LOOKUP_LONGEST_NGRAM = 4
MAX_LOOKUP_TOKENS = 64  # the most copies one iteration may verify


@dataclass
class DecodeConfig:
    """One generation request; the CLI, the app and the benchmark fill this in."""

    method: str = "sdsat"  # "sdsat" (draft-then-verify) or "vanilla" (one token per forward pass)
    k: int = 3  # adaptive tokens (drafts) per SDSAT step, 1..the SAT spec's max_k; with the shipped adapter
    # 3 and 4 are the fastest, within run-to-run noise of each other (README, Results)
    max_new_tokens: int = 128  # stop after this many new tokens
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # greedy unless do_sample
    stop_strings: list[str] = field(default_factory=list)  # stop once the output contains one
    scheme: str = "two_step"  # SDSAT: "two_step" (the paper: draft pass, then verify pass) or "fused"
    adaptive_k: bool = False  # SDSAT two_step: shrink / grow k from recent acceptance (k is the upper bound)
    lookup_tokens: int = 0  # SDSAT two_step: when the last tokens recur, verify up to this many tokens
    # copied from after that occurrence instead of SAT drafts (prompt lookup): in one pass when the bonus
    # token completes the recurring n-gram, else in the verify pass after the draft pass's token; 0: off
    lookup_ngram: int = 2  # at least this many last tokens must recur (1 was measured worse on chat: too weak
    # a hint); longer recurring suffixes, up to LOOKUP_LONGEST_NGRAM, are preferred
    tree_candidates: int = 0  # SDSAT two_step, greedy: also verify this many of the SATs' runner-up candidates
    # (a draft tree, `tree.py`) in the verify pass; sampling verifies the chain; 0: the chain (the paper)

    def validate(self, max_k: int | None = None, max_new_tokens_limit: int = 100_000) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be between 1 and {max_new_tokens_limit}, got {self.max_new_tokens}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {self.scheme!r}")
        if self.method == "sdsat":
            if max_k is None:
                raise ValueError("SDSAT decoding needs a model with adaptive tokens (a SAT spec or adapter)")
            if not isinstance(self.k, int) or not 1 <= self.k <= max_k:
                raise ValueError(f"k (number of adaptive tokens) must be between 1 and {max_k}, got {self.k}")
            if not isinstance(self.lookup_tokens, int) or not 0 <= self.lookup_tokens <= MAX_LOOKUP_TOKENS:
                raise ValueError(f"lookup_tokens must be between 0 (off) and {MAX_LOOKUP_TOKENS}, got {self.lookup_tokens}")
            if self.lookup_tokens and self.scheme != "two_step":
                raise ValueError("lookup_tokens works with the two_step scheme only")
            if not isinstance(self.tree_candidates, int) or not 0 <= self.tree_candidates <= MAX_TREE_CANDIDATES:
                raise ValueError(f"tree_candidates must be between 0 (off) and {MAX_TREE_CANDIDATES}, got {self.tree_candidates}")
            if self.tree_candidates and self.scheme != "two_step":
                raise ValueError("tree_candidates works with the two_step scheme only")
            if not isinstance(self.lookup_ngram, int) or not 1 <= self.lookup_ngram <= 8:
                raise ValueError(f"lookup_ngram must be between 1 and 8, got {self.lookup_ngram}")
        self.sampling.validate()


@dataclass
class StepRecord:
    """One iteration. Vanilla steps emit one token and draft nothing."""

    index: int  # iteration number, from 0
    kv_len_before: int  # tokens in the cache when the iteration started
    k: int  # drafts asked for: the SATs of the draft pass, or the copies verified (0 for vanilla)
    drafts: list[int]  # d_1..d_k from the SATs, or the copies prompt lookup verified (draft_source "lookup"); with a
    # draft tree, the path the verification walked (shorter than k when it ended in a runner-up without children)
    draft_probs: list[float]  # q(d_i): the SAT's probability of its own draft (1.0 for a copy)
    predictions: list[int]  # argmax of the model after t, d_1, ..., d_k (what verification compared)
    accepted: int  # drafts accepted (a prefix of `drafts`)
    tokens: list[int]  # tokens emitted this iteration, in order (cut where decoding stops)
    sources: list[str]  # per emitted token: "verified" (step 1), "draft" (accepted) or "bonus" (step 2)
    probs: list[float]  # per emitted token: the model's probability p of it
    pass_seconds: list[float]  # wall time of each forward pass this iteration
    kv_len: int  # tokens in the cache after the iteration
    elapsed: float  # seconds since the request started, at the end of this iteration
    draft_source: str = "sat"  # "sat" (drafted by the SATs), "lookup" (copied by prompt lookup) or "" (vanilla)
    draft_ranks: list[int] = field(default_factory=list)  # greedy SAT drafts: each one's rank in its q (0: the
    # top choice; a draft tree also verifies runner-ups); empty for copies and sampled drafts
    candidates: int = 0  # drafted tokens the verify pass checked: k, the copies, or every node of a draft tree
    tree_paths: list[list[int]] = field(default_factory=list)  # a draft tree's nodes as rank paths (tree.py)
    tree_tokens: list[int] = field(default_factory=list)  # the token of each of those nodes

    @property
    def rejected(self) -> list[int]:
        return self.drafts[self.accepted:]

    @property
    def forward_passes(self) -> int:
        return len(self.pass_seconds)


@dataclass
class GenerationResult:
    """The whole generation, with the metrics of SDSAT.md."""

    method: str
    k: int  # 0 for vanilla
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str  # new tokens decoded, special tokens skipped
    seconds: float  # wall time of the request, prefill included
    prefill_seconds: float  # wall time of the first forward pass
    stop_reason: str  # "eos", "max_new_tokens" or "stop_string"
    steps: list[StepRecord]

    @property
    def forward_passes(self) -> int:
        return sum(s.forward_passes for s in self.steps)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else math.nan

    @property
    def tokens_per_forward_pass(self) -> float:
        return len(self.token_ids) / self.forward_passes if self.forward_passes else math.nan

    @property
    def mean_tokens_per_iteration(self) -> float:
        """New tokens per iteration, the verified and bonus tokens counted (vLLM's 'mean accepted length')."""
        return len(self.token_ids) / len(self.steps) if self.steps else math.nan

    @property
    def mean_accepted_drafts(self) -> float:
        """Accepted drafts per iteration, the verified and bonus tokens not counted."""
        return sum(s.accepted for s in self.steps) / len(self.steps) if self.steps else math.nan

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of iterations that drafted position i in which draft i was accepted."""
        drafted: list[int] = []
        accepted: list[int] = []
        for step in self.steps:
            for i in range(len(step.drafts)):
                if i == len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[i] += 1
                accepted[i] += i < step.accepted
        return [a / d for a, d in zip(accepted, drafted)]

    def summary(self) -> dict:
        return {
            "method": self.method,
            "k": self.k,
            "new_tokens": len(self.token_ids),
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "forward_passes": self.forward_passes,
            "tokens_per_forward_pass": self.tokens_per_forward_pass,
            "iterations": len(self.steps),
            "mean_tokens_per_iteration": self.mean_tokens_per_iteration,
            "mean_accepted_drafts": self.mean_accepted_drafts,
            "acceptance_by_position": self.acceptance_by_position,
            "stop_reason": self.stop_reason,
        }

    def to_dict(self) -> dict:
        steps = [asdict(s) | {"rejected": s.rejected} for s in self.steps]
        return self.summary() | {"prompt_ids": self.prompt_ids, "token_ids": self.token_ids, "text": self.text,
                                 "prefill_seconds": self.prefill_seconds, "steps": steps}


Event = StepRecord | GenerationResult


class _Clock:
    """Times forward passes; synchronises CUDA first so the clock reads finished work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def elapsed(self) -> float:
        return self.now() - self.start


def _rollback(cache: DynamicCache, length: int) -> None:
    """Shrink the cache to its first `length` tokens: the only place entries leave it."""
    drop = cache.get_seq_length() - length
    if drop > 0:
        cache.crop(-drop)


def decode(sat_model: SatModel | torch.nn.Module, tokenizer, prompt_ids: list[int], config: DecodeConfig,
           eos_ids: list[int], should_stop=None) -> Iterator[Event]:
    """Run one request; yields a StepRecord per iteration, then the GenerationResult.

    Args:
        sat_model: a SatModel (required for SDSAT) or a plain causal LM (vanilla only).
        prompt_ids: the encoded prompt, at least one token.
        eos_ids: ids that end the output (included in it, as `model.generate` does).
        should_stop: optional callable checked between iterations; True cancels the request and
            the result so far is returned with stop_reason "cancelled".
    """
    max_k = sat_model.max_k if isinstance(sat_model, SatModel) else None
    config.validate(max_k=max_k)
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    check_context(len(prompt_ids), config, getattr(_model_of(sat_model).config, "max_position_embeddings", None))
    if config.method == "vanilla":
        return _vanilla(sat_model, tokenizer, prompt_ids, config, eos_ids, should_stop)
    return _sdsat(sat_model, tokenizer, prompt_ids, config, eos_ids, should_stop)


def check_context(prompt_len: int, config: DecodeConfig, max_context: int | None) -> None:
    """Refuse a request whose positions would run past the model's context (None: no known limit).

    Vanilla feeds at most prompt + max_new_tokens positions; SDSAT's last verify pass also holds the
    k drafts, and the fused scheme's SAT runs reach up to 2k positions past the bonus token.
    """
    if not isinstance(max_context, int) or max_context <= 0:
        return
    drafts = 0 if config.method == "vanilla" else config.k * (2 if config.scheme == "fused" else 1)
    extra = f" plus k ({drafts} draft positions)" if drafts else ""
    if prompt_len + drafts >= max_context:
        raise ValueError(f"the prompt has {prompt_len} tokens{extra}, but the model's context is {max_context} tokens: "
                         "shorten the prompt")
    if prompt_len + config.max_new_tokens + drafts > max_context:
        raise ValueError(f"prompt ({prompt_len} tokens) plus max_new_tokens ({config.max_new_tokens}){extra} must fit "
                         f"the model's context of {max_context} tokens: max_new_tokens can be at most "
                         f"{max_context - prompt_len - drafts} for this prompt")


def _model_of(sat_model) -> torch.nn.Module:
    return sat_model.model if isinstance(sat_model, SatModel) else sat_model


def _vanilla(sat_model, tokenizer, prompt_ids, config, eos_ids, should_stop) -> Iterator[Event]:
    model = _model_of(sat_model)
    device = next(model.parameters()).device
    chooser = TokenChooser(config.sampling, device)
    stop = StopChecker(tokenizer, eos_ids, config.max_new_tokens, config.stop_strings)
    cache = DynamicCache(config=model.config)
    clock = _Clock(device)
    steps: list[StepRecord] = []
    pending = prompt_ids
    prefill_seconds = 0.0
    with torch.inference_mode():
        while True:
            kv_before = cache.get_seq_length()
            t0 = clock.now()
            logits = model(input_ids=torch.tensor([pending], device=device), cache=cache, use_cache=True,
                           logits_to_keep=1).logits
            tokens, probs = chooser.choose(logits[0, -1:])
            t1 = clock.now()
            prefill_seconds = prefill_seconds or t1 - t0
            token = int(tokens[0])
            done = stop.add(token)
            steps.append(StepRecord(len(steps), kv_before, 0, [], [], [], 0, [token], ["verified"], [float(probs[0])],
                                    [t1 - t0], cache.get_seq_length(), t1 - clock.start, ""))
            yield steps[-1]
            if done or (should_stop is not None and should_stop()):
                break
            pending = [token]
    yield _result(config, 0, prompt_ids, stop, steps, clock, prefill_seconds, tokenizer)


def _sdsat(sat_model: SatModel, tokenizer, prompt_ids, config, eos_ids, should_stop) -> Iterator[Event]:
    """The paper's two-step scheme, or the fused one (see `_fused_pass`), per `config.scheme`."""
    device = sat_model.device
    chooser = TokenChooser(config.sampling, device)
    stop = StopChecker(tokenizer, eos_ids, config.max_new_tokens, config.stop_strings)
    cache = DynamicCache(config=sat_model.model.config)
    clock = _Clock(device)
    steps: list[StepRecord] = []
    pending = list(prompt_ids)  # tokens not yet in the cache: the prompt, then each bonus token
    k_policy = _KPolicy(config.k, adaptive=config.adaptive_k and config.scheme == "two_step")
    drafts = q = None  # the fused scheme carries the next drafts from one pass to the next
    history = list(prompt_ids)  # every token so far, where prompt lookup searches
    tree_candidates = 0 if chooser.config.do_sample else config.tree_candidates  # greedy walks a tree only
    prefill_seconds = 0.0

    def copies_after(text: list[int], room: int) -> list[int]:
        return _lookup(text, config.lookup_ngram, min(config.lookup_tokens, room)) if room > 0 else []

    with torch.inference_mode():
        while True:
            k = k_policy.next_k()
            kv_before = cache.get_seq_length()
            emitted, sources, probs, pass_seconds = [], [], [], []
            # Copies beyond what may still be emitted (the bonus included) would be verified for nothing,
            # and could run past the model's context, which check_context sized for k drafts.
            room = config.max_new_tokens - (len(history) - len(prompt_ids)) - 1
            copies = copies_after(history, room) if config.lookup_tokens and drafts is None and len(pending) == 1 else []
            t0 = clock.now()
            if copies:
                # Prompt lookup found a continuation: verify the copied tokens right after the bonus
                # token, in one pass and without a draft pass (q, set below, puts all mass on them).
                drafts = torch.tensor(copies, device=device)
            elif drafts is None:
                # 1. Draft: [pending, SAT x k] gives the certain token t and the drafts d_1..d_k.
                t_tok, t_prob, q, drafts = _draft_pass(sat_model, chooser, cache, pending, k)
                emitted, sources, probs = [int(t_tok[0])], ["verified"], [float(t_prob[0])]
                pending = [int(t_tok[0])]
                pass_seconds.append(clock.now() - t0)
                prefill_seconds = prefill_seconds or pass_seconds[0]
                # t may complete a recurring n-gram: its copies are then a better bet than the SAT drafts.
                copies = copies_after(history + emitted, room - 1) if config.lookup_tokens else []
                if copies:
                    drafts = torch.tensor(copies, device=device)
            # 2. Verify [t, d_1..d_k]: p after t and after each draft (fused: and the next drafts).
            t1 = clock.now()
            base = cache.get_seq_length()
            verified_drafts, verified_q = drafts, q
            candidates, ranks = len(drafts), [] if chooser.config.do_sample else [0] * len(drafts)
            tree, nodes = None, []
            if config.scheme == "fused":
                p, accepted, bonus, q, drafts = _fused_pass(sat_model, chooser, cache, pending[0], verified_drafts, verified_q)
            elif tree_candidates and not copies:
                tree = DraftTree.for_k(len(drafts), tree_candidates)
                p, accepted, bonus, verified_drafts, ranks, nodes = _tree_pass(sat_model, chooser, cache, pending[0], q, tree)
                candidates, drafts, q = len(tree.paths), None, None
            else:
                p = chooser.probs(sat_model.forward(torch.cat([torch.tensor(pending, device=device), drafts])[None], cache=cache)[0])
                if copies:  # all mass on each copy (q(copy) = 1); only sampling reads q
                    q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype) if chooser.config.do_sample else None
                accepted, bonus = chooser.accept(p, q, drafts)  # p: (k + 1, V) model; q: (k, V) SATs
                drafts = q = None
            # 3. Keep t and the accepted drafts in the cache; the bonus is the next pending token.
            _rollback(cache, base + 1 + accepted)
            t2 = clock.now()
            pass_seconds.append(t2 - t1)
            # 4. Emit accepted drafts and the bonus, cut where vanilla decoding would stop.
            draft_list = verified_drafts.tolist()
            emitted += draft_list[:accepted] + [bonus]
            sources += ["draft"] * accepted + ["bonus"]
            probs += [float(p[i, draft_list[i]]) for i in range(accepted)] + [float(p[accepted, bonus])]
            emitted, sources, probs, done = _cut_at_stop(stop, emitted, sources, probs)
            steps.append(StepRecord(
                index=len(steps), kv_len_before=kv_before, k=len(draft_list) if copies else k, drafts=draft_list,
                draft_probs=([1.0] * len(draft_list) if copies
                             else verified_q[torch.arange(len(draft_list)), verified_drafts].tolist()),
                predictions=p.argmax(-1).tolist(), accepted=accepted, tokens=emitted, sources=sources, probs=probs,
                pass_seconds=pass_seconds, kv_len=cache.get_seq_length(), elapsed=t2 - clock.start,
                draft_source="lookup" if copies else "sat", draft_ranks=[] if copies else ranks[:len(draft_list)],
                candidates=candidates, tree_paths=[list(path) for path in tree.paths] if tree else [], tree_tokens=nodes))
            yield steps[-1]
            if done or (should_stop is not None and should_stop()):
                break
            # 5. Adapt k to recent SAT acceptance (when asked), and continue from the bonus token.
            if not copies:
                k_policy.update(accepted, k)
            history += emitted
            pending = [bonus]
    yield _result(config, config.k, prompt_ids, stop, steps, clock, prefill_seconds, tokenizer)


def _draft_pass(sat_model: SatModel, chooser: TokenChooser, cache, pending: list[int], k: int):
    """Step 1: feed [pending, SAT x k]; returns t (1,), p(t) (1,), q (k, V) and drafts (k,).

    The pending tokens stay in the cache, the SATs leave it.
    """
    device = sat_model.device
    kv_before, n = cache.get_seq_length(), len(pending)
    ids = torch.tensor([pending + [0] * k], device=device)
    slots = torch.cat([torch.full((n,), -1, device=device), sat_model.sat_block(k)])[None]
    logits = sat_model.forward(ids, slots, cache=cache, logits_to_keep=k + 1)[0]  # (1 + k, V)
    _rollback(cache, kv_before + n)
    t_tok, t_prob = chooser.choose(logits[:1])
    q = chooser.probs(logits[1:])  # q_i: the SAT's distribution for draft i
    return t_tok, t_prob, q, _drafts_from(chooser, q)


def _drafts_from(chooser: TokenChooser, q: torch.Tensor) -> torch.Tensor:
    """(k, V) draft distributions -> (k,) drafts: sampled when sampling, else argmax."""
    if chooser.config.do_sample:
        return torch.multinomial(q, 1, generator=chooser.generator).squeeze(-1)
    return q.argmax(-1)


def _fused_pass(sat_model: SatModel, chooser: TokenChooser, cache, c: int, drafts: torch.Tensor, q: torch.Tensor):
    """Verify the drafts and draft the next block in one forward pass.

    Feeds [c, d_1..d_k] followed by one run of k SATs anchored at each of c, d_1, ..., d_k (a small
    tree: one branch per possible accepted length a). Once verification has fixed a, the run
    anchored at d_a (c for a = 0) has seen exactly the accepted context, so its SATs are valid
    drafts for the tokens after the bonus. Each pass then yields a + 1 tokens and the next drafts.
    Returns p (k + 1, V), accepted a, the bonus token, next q (k, V) and next drafts (k,).
    """
    device = sat_model.device
    k = len(drafts)
    kv_before = cache.get_seq_length()
    layout = SatLayout.runs_at(k + 1, torch.arange(k + 1), k)
    block = torch.cat([torch.tensor([c], device=device), drafts, torch.zeros(layout.num_sats, dtype=torch.long, device=device)])
    mask = _behind_cache(layout.attention_mask(), kv_before, device)
    inputs = dict(input_ids=block[None], sat_slots=layout.sat_slots.to(device), cache=cache, attention_mask=mask,
                  position_ids=layout.position_ids.to(device) + kv_before)
    # Only k + 1 verify rows and the k rows of one branch need logits; projecting just those onto the
    # vocabulary saves k * k - k rows of the largest matrix (a tenth of the pass at k = 3 on a CPU).
    if sat_model.plain_head:
        rows, project = sat_model.hidden_states(**inputs)[0], sat_model.head
    else:  # logits of every row, as the model's own head computes them
        rows, project = sat_model.forward(**inputs)[0], (lambda logits: logits)
    p = chooser.probs(project(rows[:k + 1]))
    accepted, bonus = chooser.accept(p, q, drafts)
    next_q = chooser.probs(project(rows[k + 1 + accepted * k:k + 1 + (accepted + 1) * k]))
    return p, accepted, bonus, next_q, _drafts_from(chooser, next_q)


def _tree_pass(sat_model: SatModel, chooser: TokenChooser, cache, t: int, q: torch.Tensor, tree: DraftTree):
    """Greedy verify pass over [t, every candidate of `tree`]; keeps t and the accepted path in the cache.

    Returns p (rows of t and the shown path, (len(path) + 1, V)), accepted, the bonus token, the shown
    path's tokens (accepted ones first), their ranks in q, and every node's token.
    """
    device = sat_model.device
    base = cache.get_seq_length()
    tokens, ranks = tree.candidates(q)
    logits = sat_model.forward(torch.cat([torch.tensor([t], device=device), tokens])[None], cache=cache,
                               attention_mask=_behind_cache(tree.attention_mask, base, device),
                               position_ids=tree.position_offsets.to(device) + base)[0]
    p = chooser.probs(logits)
    predictions, node_tokens = p.argmax(-1).tolist(), tokens.tolist()
    accepted, shown = tree.walk(predictions, node_tokens)
    _keep_rows(cache, base, 1 + len(tokens), [0] + [i + 1 for i in accepted])
    rows = [0] + [i + 1 for i in shown]
    return p[rows], len(accepted), predictions[rows[len(accepted)]], tokens[shown], [ranks[i] for i in shown], node_tokens


def _behind_cache(mask: torch.Tensor, cached: int, device: torch.device) -> torch.Tensor:
    """A block's (1, 1, T, T) boolean mask widened to (1, 1, T, cached + T): every row sees the whole cache."""
    mask = mask.to(device)
    return torch.cat([torch.ones(*mask.shape[:3], cached, dtype=torch.bool, device=device), mask], -1)


def _keep_rows(cache: DynamicCache, base: int, block: int, rows: list[int]) -> None:
    """Of the last `block` rows just added after `base`, keep `rows` (ascending offsets) at base, base + 1, ...

    Keys are stored after the rotary embedding, so a row keeps its position wherever it is moved. Rows
    are found from each layer's end, which also holds for layers that keep only a recent window.
    """
    if rows != list(range(len(rows))):
        index = torch.tensor(rows, device=cache.layers[0].keys.device)
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):
                first = kv.shape[-2] - block
                kv[..., first:first + len(rows), :] = kv[..., first + index, :]
    _rollback(cache, base + len(rows))


def _lookup(history: list[int], ngram: int, max_tokens: int) -> list[int]:
    """Prompt lookup: up to `max_tokens` tokens that followed the first occurrence of the longest recurring
    suffix of `history` (at least `ngram`, at most max(ngram, LOOKUP_LONGEST_NGRAM) tokens); [] if none.

    The first occurrence, as transformers' prompt lookup takes: in text that repeats with a short period
    the latest one is followed by only a few tokens before the text ends (offline on HumanEval outputs:
    2.69 against 2.52 tokens per pass; on chat answers 1.87 against 1.66).
    """
    for n in range(max(ngram, LOOKUP_LONGEST_NGRAM), ngram - 1, -1):
        if len(history) <= n:
            continue
        tail, end, start = history[-n:], len(history) - n, -1
        while True:  # candidates by the first token, found at C speed (this runs twice per iteration)
            try:
                start = history.index(tail[0], start + 1, end)
            except ValueError:
                break
            if history[start:start + n] == tail:
                return history[start + n:start + n + max_tokens]
    return []


def _cut_at_stop(stop: StopChecker, tokens: list[int], sources: list[str], probs: list[float]):
    """Feed tokens to the stop checker; cut them (and their sources / probs) after the last one."""
    for count, token in enumerate(tokens, 1):
        if stop.add(token):
            return tokens[:count], sources[:count], probs[:count], True
    return tokens, sources, probs, False


class _KPolicy:
    """k per iteration: fixed, or one more than the recent accepted length, bounded by the request's k."""

    def __init__(self, k: int, adaptive: bool):
        self.k_max, self.adaptive, self.k = k, adaptive, k
        self.recent = float(k)  # exponential average of accepted drafts

    def next_k(self) -> int:
        return self.k

    def update(self, accepted: int, k: int) -> None:
        if not self.adaptive:
            return
        self.recent = 0.7 * self.recent + 0.3 * accepted
        self.k = max(1, min(self.k_max, round(self.recent) + 2))


def _result(config, k, prompt_ids, stop: StopChecker, steps, clock: _Clock, prefill_seconds, tokenizer) -> GenerationResult:
    return GenerationResult(
        method=config.method, k=k, prompt_ids=list(prompt_ids), token_ids=list(stop.tokens),
        text=tokenizer.decode(stop.tokens, skip_special_tokens=True), seconds=clock.elapsed(),
        prefill_seconds=prefill_seconds, stop_reason=stop.reason or "cancelled", steps=steps)


def run(events: Iterator[Event]) -> GenerationResult:
    """Drain a decoder and return its result."""
    for event in events:
        if isinstance(event, GenerationResult):
            return event
    raise RuntimeError("decoder ended without a result")
