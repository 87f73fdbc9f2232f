"""Train the sampler head (sdsat/head.py) over stored features of a frozen model and its frozen SAT adapter.

Stages of `python -m sdsat.train.head`, each resumable:
  1. extract: the base model and the shipped adapter run once over text, a run of SATs after every `stride`-th
     position, under the training's mask. The text is a self-distillation corpus (`--corpus`, built by
     `python -m sdsat.train.corpus`) or windows of standard-library files (`--stdlib`, no generation). Per SAT
     row it keeps what the head reads and learns from: the SAT's final hidden state, its top candidates and
     their logits, the token before the drafted one, the model's own greedy token there (the target), the
     standard token's final hidden state at that position (the latent target), and how often the token before
     (and the two tokens before) were followed by each candidate earlier in the text. One file per chunk of
     sequences, written atomically; a stopped run resumes at the first missing chunk (`--add-seen` gives older
     chunks the counts of pairs and triples).
  2. bigrams: a table of adjacent-token counts over Python files and their prose on this machine.
  3. train: the head learns over the stored rows in minutes. Teacher forcing with the true previous token is
     exactly the decoding-time input: draft j matters only when drafts 1..j-1 were accepted, i.e. equal the
     model's own tokens. Loss per row: cross-entropy of the target among the K candidates, weighted up where
     the SAT's own top choice misses it (on-policy: where the current drafts fail); KL from the model's
     distribution over the candidates (which sampling's accept test rewards); with an MLP, a latent consistency
     term pulling h_j + u toward the standard token's state. Seeded, checkpointed, a progress bar, a record.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from ..head import HeadConfig, SamplerHead, seen_after
from ..layout import SatLayout
from .precision import resolve_batched_dtype
from .trainer import relative_distance, write_atomically

log = logging.getLogger(__name__)

STORED_CANDIDATES = 32  # candidates kept per SAT row: any head with K up to this trains on the same features


@dataclass
class HeadTrainConfig:
    """Everything a head run needs; the CLI fills it from flags."""

    out: str = "runs/head/run"  # run folder: checkpoint, record, the trained head (head/)
    features: str = "runs/head/features"  # extracted features (stage 1's output); several: comma-separated, the
    # held-out share is taken from the last
    bigrams: str = ""  # a bigram table (`python -m sdsat.train.head bigrams`) for the head's w_j log P(c | prev)
    context: bool = False  # the head also reads how often prev was followed by each candidate earlier in the text
    context3: bool = False  # ... and how often the two tokens before the draft were (features with `seen3`)
    init_from: str = ""  # a trained head's folder: its table weights and bigram table start this run, which
    # then begins exactly at that head (the MLP's output starts at zero); its table terms and K must match
    table_lr: float = 0.0  # peak learning rate of the table weights w_j, v_j, x_j (0: `lr`)
    width: int = 512  # head: hidden units of the MLP (0: none, the bigram term alone)
    depth: int = 1  # head: hidden layers (2: the two-layer variant)
    dropout: float = 0.0  # head: dropout of the MLP's hidden units while training
    candidates: int = 16  # head: K, top candidates rescored (at most STORED_CANDIDATES)
    combiner: int = 0  # head: hidden units of the per-candidate combiner of its terms (0: none)
    steps: int = 1500  # optimizer steps
    batch_size: int = 1024  # SAT rows per step
    lr: float = 2e-3  # peak learning rate (AdamW), cosine to 0 after `warmup`
    warmup: int = 50  # warm-up steps
    weight_decay: float = 0.01  # AdamW
    miss_weight: float = 1.0  # on-policy: extra CE weight where the SAT's own top choice misses the target
    kl_weight: float = 0.5  # KL(p || q) over the candidates, p the model's own distribution there
    latent_weight: float = 0.1  # latent consistency: relative squared distance of h_j + u to the standard state
    max_rows: int = 0  # train on the first this many rows only (0: all): the learning curve's lever
    held_out: float = 0.05  # share of the sequences (the last chunks) kept for evaluation
    slots: int = 4  # SAT positions trained (the features hold this many or more); later ones share the last one's
    seed: int = 0  # seeds initialisation and batch order
    checkpoint_every: int = 250  # steps between checkpoints
    eval_every: int = 250  # steps between held-out evaluations

    def validate(self) -> None:
        if not 1 <= self.candidates <= STORED_CANDIDATES:
            raise ValueError(f"candidates must be between 1 and {STORED_CANDIDATES}, got {self.candidates}")
        if self.depth < 1 or self.width < 0 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("depth, steps and batch_size must be at least 1, width at least 0")
        if not self.width and not self.bigrams and not self.context and not self.context3 and not self.init_from:
            raise ValueError("a head needs an MLP (width > 0), a bigram table (--bigrams), --context or --context3")
        if self.table_lr < 0:
            raise ValueError(f"table_lr must be at least 0 (0: the same as lr), got {self.table_lr}")
        if self.init_from and self.bigrams:
            raise ValueError("init_from brings its own bigram table: leave out bigrams")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be at least 0 and below 1, got {self.dropout}")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be a share between 0 and 1, got {self.held_out}")


# -- stage 1: features ------------------------------------------------------------------------------

@torch.inference_mode()
def sequence_features(sat_model, ids: list[int], start: int, k: int, stride: int) -> dict[str, torch.Tensor] | None:
    """Features of one sequence: a run of k SATs after every `stride`-th position p >= start - 1 whose k
    drafts fall inside it (the draft pass that fed token p). Rows are run by run, slot by slot; None when
    no run fits. SAT j of a run after p stands for position p + j (j from 1), drafts the token after it,
    and is conditioned on the token at p + j."""
    n = len(ids)
    anchors = torch.arange(max(start - 1, 0), n - k - 1, stride)
    if not len(anchors):
        return None
    device, model = sat_model.device, sat_model.model
    layout = SatLayout.runs_at(n, anchors, k)
    mask, positions = layout.attention_mask().to(device), layout.position_ids.to(device)
    slots = layout.sat_slots.to(device)
    tokens = torch.tensor([ids], device=device)
    cache = DynamicCache(config=model.config)
    standard = sat_model.hidden_states(tokens, cache=cache, attention_mask=mask[..., :n, :n],
                                       position_ids=positions[:, :n])[0]  # (n, H)
    sats = sat_model.hidden_states(torch.zeros(1, layout.num_sats, dtype=torch.long, device=device), slots[:, n:],
                                   cache=cache, attention_mask=mask[..., n:, :], position_ids=positions[:, n:])[0]
    where = layout.target_positions.to(device)  # (M,) p + j: the position each SAT stands for
    z = sat_model.head(sats)  # (M, V) as the draft pass computes them
    cand_logits, cand = z.float().topk(STORED_CANDIDATES, dim=-1)
    target = sat_model.head(standard[where]).argmax(-1)  # the model's own next token after p + j
    return {"sat_hidden": sats.to(torch.bfloat16).cpu(), "std_hidden": standard[where].to(torch.bfloat16).cpu(),
            "cand": cand.int().cpu(), "cand_logits": cand_logits.half().cpu(), "prev": tokens[0, where].int().cpu(),
            "target": target.int().cpu(), "slot": layout.slot.to(torch.int8),
            "seen": seen_after(tokens[0], where, cand).short().cpu(),
            "seen3": seen_after(tokens[0], where, cand, order=3).short().cpu()}


def add_seen(paths: list[Path], sequences: list[tuple[list[int], int]], k: int, stride: int, chunk: int) -> int:
    """Give chunks extracted before the context terms their counts of pairs and triples (`seen_after`), rebuilt
    from their sequences; returns how many chunks changed. The rows' own `prev` must match the sequences
    (ValueError otherwise)."""
    changed = 0
    for index, path in enumerate(paths):
        rows = torch.load(path)
        if not rows or ("seen" in rows and "seen3" in rows):
            continue
        seen = []
        for ids, start in sequences[index * chunk:(index + 1) * chunk]:
            anchors = torch.arange(max(start - 1, 0), len(ids) - k - 1, stride)
            if len(anchors):
                where = SatLayout.runs_at(len(ids), anchors, k).target_positions
                seen.append((torch.tensor(ids), where))
        where_all = torch.cat([w for _, w in seen])
        prev = torch.cat([ids[w] for ids, w in seen])
        if len(prev) != len(rows["prev"]) or not torch.equal(prev.int(), rows["prev"]):
            raise ValueError(f"{path} does not match these sequences: extract it again with the same source")
        for name, order in (("seen", 2), ("seen3", 3)):
            counts, offset = [], 0
            for ids, w in seen:
                counts.append(seen_after(ids, w, rows["cand"][offset:offset + len(w)].long(), order=order))
                offset += len(w)
            rows[name] = torch.cat(counts).short()
            assert len(where_all) == len(rows[name])
        tmp = path.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.replace(path)
        changed += 1
    return changed


def extract(sat_model, sequences: list[tuple[list[int], int]], out: Path, k: int = 4, stride: int = 2,
            chunk: int = 32, progress: bool = True) -> list[Path]:
    """Stage 1 over (ids, completion start) pairs, `chunk` sequences per file; files already there are kept.
    Returns every chunk file, in order."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    starts = range(0, len(sequences), chunk)
    for index, first in enumerate(tqdm(starts, desc="head features", unit="chunk", disable=not progress)):
        path = out / f"chunk-{index:05d}.pt"
        paths.append(path)
        if path.is_file():
            continue
        parts = [f for ids, start in sequences[first:first + chunk] if (f := sequence_features(sat_model, ids, start,
                                                                                              k, stride))]
        merged = {name: torch.cat([p[name] for p in parts]) for name in parts[0]} if parts else {}
        tmp = path.with_suffix(".tmp")
        torch.save(merged, tmp)
        tmp.replace(path)
    return paths


def load_features(folders: str | Path, slots: int) -> list[dict[str, torch.Tensor]]:
    """Every chunk of each folder (comma-separated) in order, rows of SAT positions >= `slots` left out."""
    chunks = []
    paths = [p for folder in str(folders).split(",") for p in sorted(Path(folder).glob("chunk-*.pt"))]
    for path in paths:
        chunk = torch.load(path)
        if chunk:
            keep = chunk["slot"].long() < slots
            chunks.append({name: value[keep] for name, value in chunk.items()})
    if not chunks:
        raise ValueError(f"no head features in {folders}: run `python -m sdsat.train.head extract` first")
    return chunks


def merge(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    names = set(chunks[0])
    if any(set(c) != names for c in chunks):
        raise ValueError("these head features were extracted by different versions: give the older chunks their "
                         "counts with `python -m sdsat.train.head extract --add-seen`, or extract into a new --out")
    return {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}


# -- stage 2: the head ------------------------------------------------------------------------------

def head_loss(config: HeadTrainConfig, head: SamplerHead, batch: dict[str, torch.Tensor], embed_in: torch.Tensor,
              embed_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss of a batch of feature rows, and its parts."""
    k = config.candidates
    cand, z = batch["cand"][:, :k].long(), batch["cand_logits"][:, :k].float()  # (N, K)
    h, h_std = batch["sat_hidden"].float(), batch["std_hidden"].float()  # (N, H)
    cand_emb = embed_out[cand]  # (N, K, H)
    scores, u = head.scores(h, batch["prev"].long(), batch["slot"].long(), cand, z, embed_in, embed_out,
                            *_context_counts(config, batch))
    target = batch["target"].long()
    hit = cand == target[:, None]  # (N, K)
    inside = hit.any(-1)
    miss = (cand[:, 0] != target).float()  # the SAT's own top choice misses: where the drafts fail now
    weight = (1 + config.miss_weight * miss) * inside.float()
    ce = F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")
    ce = (ce * weight).sum() / weight.sum().clamp(min=1)
    p = torch.einsum("nkh,nh->nk", cand_emb, h_std).log_softmax(-1)  # the model's distribution on the candidates
    kl = (p.exp() * (p - scores.log_softmax(-1))).sum(-1).mean()
    latent = relative_distance(h + u, h_std).mean()
    loss = ce + config.kl_weight * kl + config.latent_weight * latent
    return loss, {"ce": ce.item(), "kl": kl.item(), "latent": latent.item()}


def _context_counts(config: HeadTrainConfig, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """The rows' counts of pairs and triples at the head's K candidates, each None where the head does not read it."""
    k = config.candidates
    return (rows["seen"][:, :k] if config.context else None, rows["seen3"][:, :k] if config.context3 else None)


@torch.no_grad()
def evaluate(config: HeadTrainConfig, head: SamplerHead | None, rows: dict[str, torch.Tensor], embed_in, embed_out,
             batch: int = 4096) -> dict[str, list[float]]:
    """Teacher-forced acceptance per SAT position on held-out rows, the head's and the SATs' own: draft j
    counts where it and the drafts before it in its run equal the model's tokens (cumulative)."""
    slot = rows["slot"].long()
    top = []
    was_training = head.training
    head.eval()
    for first in range(0, len(slot), batch):
        part = {name: value[first:first + batch] for name, value in rows.items()}
        cand, z = part["cand"][:, :config.candidates].long(), part["cand_logits"][:, :config.candidates].float()
        scores, _ = head.scores(part["sat_hidden"].float(), part["prev"].long(), part["slot"].long(), cand, z,
                                embed_in, embed_out, *_context_counts(config, part))
        top.append(cand.gather(-1, scores.argmax(-1, keepdim=True))[:, 0])
    head.train(was_training)
    right = {"head": torch.cat(top) == rows["target"].long(), "sats": rows["cand"][:, 0] == rows["target"]}
    runs = int((slot == 0).sum())
    per_run = int(slot.max()) + 1
    result = {}
    for name, ok in right.items():
        chains = ok.view(runs, per_run).int().cumprod(-1).float().mean(0)
        result[name] = [round(float(a), 4) for a in chains]
    return result


def train(config: HeadTrainConfig, embed_in: torch.Tensor, embed_out: torch.Tensor, base_model: str,
          chunks: list[dict[str, torch.Tensor]] | None = None, progress: bool = True,
          stop_at: int | None = None) -> dict:
    """Stage 2; resumes from `out`/checkpoint.pt when there is one. `stop_at` ends the run after that step
    (as an interruption would), for the resume test. Returns the training record."""
    config.validate()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = chunks if chunks is not None else load_features(config.features, config.slots)
    held = max(1, round(len(chunks) * config.held_out)) if len(chunks) > 1 else 0
    train_rows = merge(chunks[:len(chunks) - held] if held else chunks)
    eval_rows = merge(chunks[len(chunks) - held:]) if held else train_rows
    if config.max_rows:
        whole_runs = config.max_rows - config.max_rows % config.slots  # keep runs whole
        train_rows = {name: value[:whole_runs] for name, value in train_rows.items()}
    total = len(train_rows["target"])
    torch.manual_seed(config.seed)
    hidden = train_rows["sat_hidden"].shape[1]
    start_head = SamplerHead.load(config.init_from) if config.init_from else None
    head = SamplerHead(HeadConfig(base_model=base_model, hidden_size=hidden, num_sats=config.slots,
                                  width=config.width, depth=config.depth, dropout=config.dropout,
                                  candidates=config.candidates, combiner=config.combiner,
                                  vocab_size=len(embed_out) if config.bigrams or (
                                      start_head and start_head.config.vocab_size) else 0,
                                  context=config.context, context3=config.context3))
    if start_head is not None:
        _start_from(head, start_head)
    if config.context and "seen" not in train_rows:
        raise ValueError("--context needs features with context counts: "
                         "run `python -m sdsat.train.head extract --add-seen` on them")
    if config.context3 and "seen3" not in train_rows:
        raise ValueError("--context3 needs features with counts of triples: "
                         "run `python -m sdsat.train.head extract --add-seen` on them")
    if config.bigrams:
        head.set_bigrams(torch.load(config.bigrams))
    embed_in, embed_out = embed_in.detach().float(), embed_out.detach().float()
    tables = [head.pair_weight, head.context_weight, head.context3_weight]
    rest = [p for p in head.parameters() if all(p is not t for t in tables)]
    groups = [{"params": tables, "lr": config.table_lr or config.lr}] + ([{"params": rest}] if rest else [])
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - config.warmup) / max(1, config.steps - config.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(config.seed)
    record = {"config": asdict(config), "train_rows": total, "eval_rows": len(eval_rows["target"]),
              "steps": [], "evals": []}
    start, wall = 0, 0.0
    checkpoint = out / "checkpoint.pt"
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != asdict(config):
            raise ValueError(f"{checkpoint} was made with another configuration; use a new --out or delete it")
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        record, start, wall = state["record"], state["step"], state["wall"]
    began = time.perf_counter() - wall
    bar = tqdm(range(start, config.steps), desc="sampler head", unit="step", disable=not progress,
               initial=start, total=config.steps)
    for step in bar:
        index = torch.randint(0, total, (config.batch_size,), generator=generator)
        loss, parts = head_loss(config, head, {name: value[index] for name, value in train_rows.items()},
                                embed_in, embed_out)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        done = step + 1
        record["steps"].append({"step": done, "loss": round(loss.item(), 5), **{n: round(v, 5) for n, v in
                                                                               parts.items()},
                                "rows_seen": done * config.batch_size})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if done % config.eval_every == 0 or done == config.steps:
            record["evals"].append({"step": done, "acceptance": evaluate(config, head, eval_rows, embed_in,
                                                                         embed_out)})
        if done % config.checkpoint_every == 0 or done == config.steps or done == stop_at:
            _checkpoint(checkpoint, config, head, optimizer, scheduler, generator, record, done,
                        time.perf_counter() - began)
        if done == stop_at:
            return record
    record["wall_seconds"] = round(time.perf_counter() - began, 1)
    head.save(out / "head")
    write_atomically(out / "training_record.json", json.dumps(record) + "\n")
    return record


def _start_from(head: SamplerHead, start: SamplerHead) -> None:
    """Give `head` the table weights and bigram table of a trained head of the same table terms (K may differ)."""
    mine, theirs = head.config, start.config
    for name in ("hidden_size", "num_sats", "vocab_size", "context", "context3"):  # K may differ: the weights
        if getattr(mine, name) != getattr(theirs, name):                           # are per SAT position
            raise ValueError(f"init_from: the head there has {name} {getattr(theirs, name)}, this run "
                             f"{getattr(mine, name)}; give the run the same (--slots, --context, --context3)")
    if theirs.width:
        raise ValueError("init_from: start from a head of table terms alone (width 0)")
    if theirs.vocab_size:
        head.set_bigrams({"bigram_keys": start.bigram_keys, "bigram_counts": start.bigram_counts,
                          "prev_counts": start.prev_counts})
    with torch.no_grad():
        for name in ("pair_weight", "context_weight", "context3_weight"):
            getattr(head, name).copy_(getattr(start, name))


def _checkpoint(path: Path, config, head, optimizer, scheduler, generator, record, step: int, wall: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"config": asdict(config), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "generator": generator.get_state(), "record": record,
                "step": step, "wall": wall}, tmp)
    tmp.replace(path)


# -- CLI --------------------------------------------------------------------------------------------

def corpus_sequences(folder: Path, modes: list[str]) -> list[tuple[list[int], int]]:
    """(ids, completion start) of every sequence of a corpus build in these decodings."""
    from .corpus import load_shards

    return [(seq["ids"], seq["prompt_tokens"]) for seq in load_shards(folder) if seq["mode"] in modes]


def bigram_texts(python_files: int, doc_files: int, seed: int = 0) -> list[str]:
    """Text for the bigram table: Python files of the standard library and installed packages, and their
    prose (.md / .rst / .txt), a seeded sample of each; anything overlapping HumanEval is left out."""
    import random

    from .corpus import python_files as all_python_files, python_roots
    from .data import HumanEvalFilter

    rng, keep = random.Random(seed), HumanEvalFilter()
    roots = python_roots()
    code = all_python_files(roots)
    docs = sorted({p for root in roots for ext in ("*.md", "*.rst", "*.txt") for p in root.rglob(ext)
                   if 500 < p.stat().st_size < 400_000})
    rng.shuffle(code)
    rng.shuffle(docs)
    texts = []
    for path in code[:python_files] + docs[:doc_files]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not keep(text):
            texts.append(text)
    return texts


def count_bigrams(tokenizer, texts: list[str], vocab: int, progress: bool = True) -> dict[str, torch.Tensor]:
    """Counts of adjacent token pairs over `texts`: {"bigram_keys": (P,) prev * vocab + next, sorted;
    "bigram_counts": (P,); "prev_counts": (vocab,) how often each token is followed by any}."""
    keys = []
    for text in tqdm(texts, desc="bigrams", unit="file", disable=not progress):
        ids = torch.tensor(tokenizer.encode(text))
        keys.append(ids[:-1] * vocab + ids[1:])
    unique, counts = torch.cat(keys).unique(return_counts=True)
    return {"bigram_keys": unique, "bigram_counts": counts.float(),
            "prev_counts": torch.bincount(unique // vocab, weights=counts.float(), minlength=vocab)}


def stdlib_windows(tokenizer, files: int, length: int = 256, seed: int = 0) -> list[tuple[list[int], int]]:
    """(ids, 1) windows of `length` tokens cut from standard-library files (HumanEval overlaps left out)."""
    import random

    from .data import HumanEvalFilter, code_documents, stdlib_files

    windows = []
    for text in code_documents(stdlib_files(files, random.Random(seed)), HumanEvalFilter()):
        ids = tokenizer.encode(text)
        windows += [(ids[i:i + length], 1) for i in range(0, len(ids) - length + 1, length)]
    random.Random(seed).shuffle(windows)
    return windows


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.train.head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    ex = sub.add_parser("extract", help="stage 1: features of the frozen model and adapter over a corpus")
    source = ex.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="a folder of `python -m sdsat.train.corpus`")
    source.add_argument("--stdlib", type=int, metavar="FILES",
                        help="windows of this many standard-library files instead (raw code, no generation): "
                             "each SAT is conditioned on the text's token and targets the model's own next token")
    ex.add_argument("--modes", nargs="*", default=["greedy"], help="its decodings to use (default greedy)")
    ex.add_argument("--adapter", default=None, help="SAT adapter folder (default: the shipped one)")
    ex.add_argument("--out", default=HeadTrainConfig.features)
    ex.add_argument("--k", type=int, default=4, help="SATs per run (default 4)")
    ex.add_argument("--stride", type=int, default=2, help="a run after every this many positions (default 2)")
    ex.add_argument("--chunk", type=int, default=32, help="sequences per file (default 32)")
    ex.add_argument("--max-sequences", type=int, default=0, help="the first this many sequences only (0: all)")
    ex.add_argument("--add-seen", action="store_true",
                    help="only give chunks extracted before the context term their context counts (same source)")
    bi = sub.add_parser("bigrams", help="the bigram table the head reads (counts over code and prose on this machine)")
    bi.add_argument("--out", default="runs/head/bigrams.pt")
    bi.add_argument("--python-files", type=int, default=1500, help="Python files sampled (default 1500)")
    bi.add_argument("--doc-files", type=int, default=600, help=".md / .rst / .txt files sampled (default 600)")
    tr = sub.add_parser("train", help="stage 2: train the head over the features")
    for name, value in asdict(HeadTrainConfig()).items():
        if isinstance(value, bool):
            tr.add_argument("--" + name.replace("_", "-"), action="store_true")
        else:
            tr.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    for p in (ex, bi, tr):
        p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="precision of the model (default auto: for extract, the faster for batches on this "
                            "machine, measured)")
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = vars(parser.parse_args(argv))
    stage, dtype, threads = args.pop("stage"), args.pop("dtype"), args.pop("threads")
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ..engine import DEFAULT_ADAPTER, Engine, SatSource
    from ..models import DEFAULT_MODEL, LoadConfig, load_model

    if stage == "bigrams":
        _, tokenizer = load_model(LoadConfig(model=DEFAULT_MODEL, dtype=dtype, measure_kernels=False))
        table = count_bigrams(tokenizer, bigram_texts(args["python_files"], args["doc_files"]), len(tokenizer))
        Path(args["out"]).parent.mkdir(parents=True, exist_ok=True)
        torch.save(table, args["out"])
        print(json.dumps({"pairs": len(table["bigram_keys"]), "tokens": int(table["prev_counts"].sum())}))
        return 0
    adapter = args.pop("adapter", None) or str(DEFAULT_ADAPTER)
    if stage == "extract":
        dtype = resolve_batched_dtype(dtype, DEFAULT_MODEL)
    engine = Engine.load(LoadConfig(model=DEFAULT_MODEL, dtype=dtype, measure_kernels=False),
                         SatSource(adapter=adapter) if stage == "extract" else None)
    model = engine.sat_model.model
    if stage == "extract":
        sequences = (corpus_sequences(Path(args["corpus"]), args["modes"]) if args["corpus"]
                     else stdlib_windows(engine.tokenizer, args["stdlib"]))
        if args["max_sequences"]:
            sequences = sequences[:args["max_sequences"]]
        if args["add_seen"]:
            paths = sorted(Path(args["out"]).glob("chunk-*.pt"))
            changed = add_seen(paths, sequences, args["k"], args["stride"], args["chunk"])
            print(json.dumps({"chunks": len(paths), "given_context_counts": changed}))
            return 0
        paths = extract(engine.sat_model, sequences, Path(args["out"]), args["k"], args["stride"], args["chunk"])
        print(json.dumps({"chunks": len(paths), "sequences": len(sequences)}))
        return 0
    config = HeadTrainConfig(**args)
    record = train(config, model.get_input_embeddings().weight, model.get_output_embeddings().weight, DEFAULT_MODEL)
    print(json.dumps({"train_rows": record["train_rows"], "evals": record["evals"][-1:]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
