"""What a forward pass costs on this machine, and whether a row comes out the same alone or in a batch.

Speculative decoding pays when its tokens per pass exceed what its wider passes cost against a
one-token pass, and that cost curve depends on the processor, the precision and the kernels
(docs/architecture.md, "Why the CPU matters"). `measure_curve` times the real passes on the loaded
model: plain causal blocks of 1..32 tokens (vanilla, prompt lookup, verify passes), SDSAT draft
blocks [t, SAT×k], verify passes over draft trees, whose nodes off the chain can cost more than
causal rows (row-invariant attention gives them calls of their own), and the fused scheme's passes.
`check_rows` compares each row of a block with the same token computed alone, which is what greedy
identity rests on.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import torch
from transformers import DynamicCache

from . import timing
from .compute import compute_thread
from .drafters import DraftContext, conditioned_draft_pass, sat_drafts
from .kvcache import behind_cache, new_cache, rollback
from .records import StepRecord
from .sampling import SamplingConfig, TokenChooser
from .sat import SatModel
from .tree import MAX_EXTRA, DraftTree
from .verify import fused_block

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)  # plain block sizes timed; others take the next timed one
CONTEXT = 256  # tokens in the KV cache while timing: a prompt and some output, as when decoding
# Largest difference between a row computed alone and in a block, relative to the row's largest logit, that
# still counts as "close": float32 rounding stays orders of magnitude below it, bfloat16's does not.
CLOSE_DRIFT = 1e-3
NOISY_SPREAD = 1.5


@dataclass
class CostCurve:
    """Seconds per pass of this model, in one precision and kernel routing: medians of interleaved rounds; after a
    tuning, scaled so that the one-token pass is the fastest of all its timings (`tuning._time_again`)."""

    dtype: str
    plain: dict[int, float] = field(default_factory=dict)  # block width -> seconds
    # k -> seconds of a draft pass [t, SAT×k] (k + 1 tokens) as greedy decoding runs it: t chosen, the drafts
    # through the sampler head where one is beside the SATs
    draft: dict[int, float] = field(default_factory=dict)
    tree: dict[int, float] = field(default_factory=dict)  # runner-ups -> seconds of a tree pass at depth tree_k
    tree_k: int = 0
    # k -> seconds of a fused pass [start, k drafts] with a run of k SATs after each of those (verify.py), and the
    # head's next drafts where one is beside the SATs; empty in curves measured before it was timed
    fused: dict[int, float] = field(default_factory=dict)
    # The one-token pass's slowest round over its fastest: far above 1, something else was using the cores
    # while measuring (the curve is then used but not kept).
    spread: float = 1.0
    fastest_one_s: float = 0.0  # the one-token pass's fastest round in this curve's own timing (0: not recorded)

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    @property
    def one_token_s(self) -> float:
        return self.plain[1]

    def pass_s(self, width: int) -> float:
        """Seconds of a plain block of `width` tokens: the next timed width up (the widest beyond it, scaled)."""
        timed = [w for w in sorted(self.plain) if w >= width]
        if timed:
            return self.plain[timed[0]]
        widest = max(self.plain)
        return self.plain[widest] * width / widest

    def draft_s(self, k: int) -> float:
        return self.draft[k] if k in self.draft else self.pass_s(k + 1)

    def fused_s(self, k: int) -> float:
        """Seconds of a fused pass at k: as timed, else a draft block as wide ((k + 1)² positions)."""
        if k in self.fused:
            return self.fused[k]
        return self.draft_s(k) * self.pass_s((k + 1) ** 2) / self.pass_s(k + 1)

    def tree_s(self, k: int, extra: int) -> float:
        """Seconds of a verify pass over DraftTree.for_k(k, extra): a plain block as wide, plus what the timed
        trees cost beyond their plain blocks for as many runner-ups (interpolated; extrapolated past the last)."""
        width = 1 + len(DraftTree.for_k(k, extra).paths)
        extra = width - 1 - k  # the runner-ups that fit depth k
        if not extra or not self.tree:
            return self.pass_s(width)
        points = [(0, 0.0)] + [(e, s - self.pass_s(1 + len(DraftTree.for_k(self.tree_k, e).paths)))
                               for e, s in sorted(self.tree.items())]
        below = max((p for p in points if p[0] <= extra), key=lambda p: p[0])
        above = min((p for p in points if p[0] > extra), key=lambda p: p[0], default=None)
        if above is None:  # past the widest timed tree: its cost per runner-up, on from there
            above, below = below, points[-2]
        slope = (above[1] - below[1]) / (above[0] - below[0])
        return self.pass_s(width) + max(0.0, below[1] + slope * (extra - below[0]))

    @property
    def fastest_one_token_s(self) -> float:
        """The one-token pass's fastest round, or its median where the fastest was not recorded."""
        return self.fastest_one_s or self.one_token_s

    def at_one_token_s(self, seconds: float) -> "CostCurve":
        """This curve with every pass scaled so that the one-token pass costs `seconds`: the curve's shape,
        measured in interleaved rounds, kept; its level set by a measurement over a longer span."""
        factor = seconds / self.one_token_s
        return replace(self, plain={w: s * factor for w, s in self.plain.items()},
                       draft={k: s * factor for k, s in self.draft.items()},
                       tree={e: s * factor for e, s in self.tree.items()},
                       fused={k: s * factor for k, s in self.fused.items()})

    def relative(self) -> dict[int, float]:
        """Plain pass cost by width, relative to a one-token pass."""
        return {w: s / self.one_token_s for w, s in sorted(self.plain.items())}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostCurve":
        return cls(dtype=str(data["dtype"]), plain={int(w): float(s) for w, s in data["plain"].items()},
                   draft={int(k): float(s) for k, s in data["draft"].items()},
                   tree={int(e): float(s) for e, s in data.get("tree", {}).items()},
                   tree_k=int(data.get("tree_k", 0)),
                   fused={int(k): float(s) for k, s in data.get("fused", {}).items()},
                   spread=float(data.get("spread", 1)),
                   fastest_one_s=float(data.get("fastest_one_s", 0)))


@dataclass
class RowCheck:
    """How the rows of a block compare with the same tokens computed one at a time."""

    rows: int  # rows compared
    bit_equal: int  # rows whose logits were bit-for-bit those of the token alone
    argmax_equal: int  # rows whose top token was the same
    max_drift: float  # the largest logit difference seen, relative to the row's largest logit

    @property
    def invariant(self) -> bool:
        """Every row bit-equal: greedy SDSAT reproduces vanilla's output exactly, whatever the near-ties."""
        return self.bit_equal == self.rows

    @property
    def close(self) -> bool:
        """Rows differ by rounding only (float32): greedy output equals vanilla's unless two tokens tie
        within that rounding, which every run checks."""
        return self.argmax_equal == self.rows and self.max_drift <= CLOSE_DRIFT

    def to_dict(self) -> dict:
        return asdict(self) | {"invariant": self.invariant, "close": self.close}


def priced_seconds(steps: Sequence[StepRecord], curve: CostCurve, k: int) -> float:
    """What the forward passes of these iterations cost at the curve's prices: a draft pass [t, SAT×k] costs
    `draft_s(k)` (k: the config's SATs per draft pass), a fused pass `fused_s(k)`, and every other pass `pass_s` of
    the tokens it feeds: its start token and the candidates it verifies (a vanilla pass: 1). The first pass also
    reads the prompt; it is priced as a decode pass, as vanilla's would be, because the curve times passes behind a
    filled cache."""
    seconds = 0.0
    for step in steps:
        if step.draft_pass:
            seconds += curve.draft_s(k)
        if step.kind == "tree":  # at the depth it drafted (adaptive k may have drafted fewer than k)
            seconds += curve.tree_s(step.k, step.candidates - step.k)
        elif step.kind == "fused":
            seconds += curve.fused_s(k)
        else:
            seconds += curve.pass_s(1 + step.candidates)
    return seconds


def _prefill(sat_model: SatModel, context: int, generator: torch.Generator) -> tuple[DynamicCache, int, list[int]]:
    """A cache of `context` random tokens: (the cache, the vocabulary's size, the tokens)."""
    model = sat_model.model
    vocab = model.get_input_embeddings().weight.shape[0]
    cache = new_cache(model.config)
    ids = torch.randint(0, vocab, (1, context), generator=generator).to(sat_model.device)
    with torch.inference_mode():
        sat_model.forward(ids, cache=cache, logits_to_keep=1)
    return cache, vocab, ids[0].tolist()


TREE_K = 3  # the depth of the draft trees timed (or the SATs' largest k, if smaller)
TREE_EXTRAS = (1, 2, 4, MAX_EXTRA)  # their runner-ups (those that fit that depth)


def measure_curve(sat_model: SatModel, widths=WIDTHS, drafts: int | None = None, context: int = CONTEXT,
                  repeats: int = 5, seed: int = 0, trees: bool = True) -> CostCurve:
    """Time plain blocks of each width, draft blocks [t, SAT×k] and fused passes for k = 1..`drafts` (default: the
    SATs' largest k, at most 8) and verify passes over draft trees of depth TREE_K with TREE_EXTRAS runner-ups,
    sizes interleaved in every round; medians, the first round dropped."""
    gen = torch.Generator().manual_seed(seed)
    cache, vocab, history = _prefill(sat_model, context, gen)
    device = sat_model.device
    drafts = min(sat_model.max_k, 8) if drafts is None else drafts
    greedy = TokenChooser(SamplingConfig(), device)  # draft and fused passes are timed as greedy decoding runs them
    tree_k = min(TREE_K, sat_model.max_k)
    fit = len(DraftTree.for_k(tree_k, MAX_EXTRA).paths) - tree_k if trees else 0
    blocks = ([("plain", w) for w in sorted(set(widths) | {1})] + [("draft", k) for k in range(1, drafts + 1)]
              + [("tree", e) for e in sorted({min(e, fit) for e in TREE_EXTRAS} - {0})]
              + [("fused", k) for k in range(1, drafts + 1)])
    times: dict[tuple[str, int], list[float]] = {b: [] for b in blocks}
    for _ in range(repeats + 1):
        compute_thread().serve_urgent()  # a server's visitors decode between rounds, not beside one (compute.py)
        for kind, size in blocks:
            inputs = _timed_block(kind, size, tree_k, context, vocab, gen, device)
            if kind in ("draft", "fused"):  # their drafts go through the sampler head where one is beside the SATs
                pending = inputs["input_ids"][0, :1].tolist()
                ctx = DraftContext(sat_model, greedy, cache, pending, history + pending, size, timing.Clock(device))
            start = timing.now(device)
            with torch.inference_mode():
                if kind == "draft":  # t and the drafts (drafters.py)
                    conditioned_draft_pass(ctx, size)
                elif kind == "fused" and sat_model.plain_head:  # as verify.py, then the next drafts as Fused's
                    rows = sat_model.hidden_states(**inputs, cache=cache)[0, :2 * size + 1]
                    logits = sat_model.head(rows)
                    sat_drafts(ctx, logits[size + 1:], rows[size + 1:], pending[0], history)
                else:
                    sat_model.forward(**inputs, cache=cache)
            times[(kind, size)].append(timing.now(device) - start)
            rollback(cache, context)
    median = {b: statistics.median(v[1:]) for b, v in times.items()}
    dtype = str(next(sat_model.model.parameters()).dtype).removeprefix("torch.")
    one = times[("plain", 1)][1:]
    of = {kind: {s: t for (kind_, s), t in median.items() if kind_ == kind}
          for kind in ("plain", "draft", "tree", "fused")}
    return CostCurve(dtype=dtype, plain=of["plain"], draft=of["draft"], tree=of["tree"],
                     tree_k=tree_k if of["tree"] else 0, fused=of["fused"], spread=max(one) / min(one),
                     fastest_one_s=min(one))


def _timed_block(kind: str, size: int, tree_k: int, context: int, vocab: int, gen: torch.Generator,
                 device) -> dict:
    """The inputs of one timed pass behind `context` cached tokens: SatModel.forward's (a fused pass's go to
    `hidden_states`; of a draft pass's, the first token is the pending one `conditioned_draft_pass` feeds)."""
    if kind == "fused":
        tokens = torch.randint(0, vocab, (1 + size,), generator=gen)
        return fused_block(int(tokens[0]), tokens[1:], size, context, device)
    if kind == "tree":
        tree = DraftTree.for_k(tree_k, size)
        ids = torch.randint(0, vocab, (1, 1 + len(tree.paths)), generator=gen).to(device)
        return dict(input_ids=ids, attention_mask=behind_cache(tree.attention_mask, context, device),
                    position_ids=tree.position_offsets.to(device) + context)
    width = size if kind == "plain" else size + 1
    ids = torch.randint(0, vocab, (1, width), generator=gen).to(device)
    slots = None if kind == "plain" else torch.cat([torch.tensor([-1]), torch.arange(size)])[None].to(device)
    return dict(input_ids=ids, sat_slots=slots, logits_to_keep=width)


def check_rows(sat_model: SatModel, widths=(2, 4, 8, 16, 40), context: int = 61, seed: int = 1) -> RowCheck:
    """Compare, row by row, the logits of blocks as every decoder feeds them with those of the same
    tokens fed one at a time (what vanilla computes): plain causal blocks of each width, a draft-tree
    block under its 4-D mask, and a draft block [t, SAT×k] (whose first row is the token SDSAT keeps
    for sure). With 61 tokens cached, the blocks' rows see counts of keys on both sides of 64, where the
    tiled attention (attention.py) cuts a block into calls of different key widths; so do the tree's
    runner-ups, which it gathers into one batched call per key width."""
    gen = torch.Generator().manual_seed(seed)
    cache, vocab, _ = _prefill(sat_model, context, gen)
    device = sat_model.device
    alone_rows, block_rows = [], []
    with torch.inference_mode():
        for width in widths:
            ids = torch.randint(0, vocab, (1, width), generator=gen).to(device)
            alone = [sat_model.forward(ids[:, i:i + 1], cache=cache, logits_to_keep=1)[0, -1] for i in range(width)]
            rollback(cache, context)
            block = sat_model.forward(ids, cache=cache, logits_to_keep=width)[0]
            rollback(cache, context)
            alone_rows += alone
            block_rows += list(block)
        # A tree's chain rows (t, then depth 1, 2, ...) see what a plain block's do; its runner-ups ride along.
        tree = DraftTree.for_k(3, MAX_EXTRA)
        ids = torch.randint(0, vocab, (1, 1 + len(tree.paths)), generator=gen).to(device)
        chain = [0] + [1 + i for i, p in enumerate(tree.paths) if set(p) == {0}]
        alone = [sat_model.forward(ids[:, i:i + 1], cache=cache, logits_to_keep=1)[0, -1] for i in chain]
        rollback(cache, context)
        block = sat_model.forward(ids, cache=cache, attention_mask=behind_cache(tree.attention_mask, context, device),
                                  position_ids=tree.position_offsets.to(device) + context)[0]
        rollback(cache, context)
        alone_rows += alone
        block_rows += [block[i] for i in chain]
        # A runner-up sees the cache, t, its ancestors and itself, not the chain between (keys gathered, not a
        # prefix; the runner-ups of one key count attend in one batched call): alone, after t and its ancestors.
        for node, path in enumerate(tree.paths):
            if set(path) == {0}:
                continue
            ancestors = [1 + tree.paths.index(path[:depth]) for depth in range(1, len(path))]
            for row in [0] + ancestors:
                sat_model.forward(ids[:, row:row + 1], cache=cache, logits_to_keep=1)
            alone_rows.append(sat_model.forward(ids[:, node + 1:node + 2], cache=cache, logits_to_keep=1)[0, -1])
            block_rows.append(block[node + 1])
            rollback(cache, context)
        k = min(3, sat_model.max_k)
        slots = torch.cat([torch.tensor([-1]), torch.arange(k)])[None].to(device)
        draft = sat_model.forward(ids[:, :k + 1], slots, cache=cache, logits_to_keep=k + 1)[0, 0]
        rollback(cache, context)
        alone_rows.append(sat_model.forward(ids[:, :1], cache=cache, logits_to_keep=1)[0, -1])
        block_rows.append(draft)
        rollback(cache, context)
    pairs = list(zip(alone_rows, block_rows))
    drift = max(float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-30)) for a, b in pairs)
    return RowCheck(rows=len(pairs), bit_equal=sum(bool(torch.equal(a, b)) for a, b in pairs),
                    argmax_equal=sum(int(a.argmax()) == int(b.argmax()) for a, b in pairs), max_drift=drift)
