"""Drafters: where the candidates of an SDSAT iteration come from.

Each drafter proposes candidates for the next verify pass (`propose`) and then learns how many were
accepted (`observe`), as transformers' candidate generators do; the verify loop in decoding.py does
not care where the candidates came from. A drafter that needs the model's certain next token t first
runs the draft pass [pending, SAT x k], whose logits at the last pending token give t and at SAT j give
the draft distribution q_j.

* `SatChain`: the paper's scheme: k SAT drafts, verified as a chain (k may adapt to acceptance).
* `SatTree`: the same draft pass; the verify pass also checks the SATs' runner-up candidates (tree.py),
  or under sampling more draws of each SAT.
* `PromptLookup`: where the last tokens occurred before, the tokens that followed them there (copies),
  verified right after the bonus token without a draft pass; otherwise a SAT drafter's draft pass,
  and the copies after its token t if t completed a recurring n-gram. How many copies it verifies, and
  whether it verifies them at all, follows how many it got right so far in this decode (`LookupGate`).
* `Fused`: each verify pass also drafts the next block, so after the first iteration there is no
  draft pass at all.

Where the SAT adapter has a sampler head beside it (head.py), every draft pass drafts through it: draft 1
is conditioned on t, draft j on draft j - 1, and q is the head's own distribution. The fused scheme's
later drafts come from its verify pass through the head too, draft 1 conditioned on that pass's bonus token.

A new drafter is one class here plus a line in `drafter_for`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .config import DecodeConfig
from .head import head_drafts
from .kvcache import rollback
from .sampling import TokenChooser
from .sat import SatModel
from .timing import Clock
from .tree import DraftTree
from .verify import Verdict

# Prompt lookup prefers the longest recurring suffix up to this many tokens: a longer match is a more
# specific hint of what follows.
LOOKUP_LONGEST_NGRAM = 4
RECENT = 0.3  # the weight of the latest iteration in a drafter's running averages of what was accepted


class LookupGate:
    """When prompt lookup's copies are worth a verify pass, from how many were right so far in this decode.

    A verify pass costs more the more tokens it checks, and copies pay only where the text repeats: on text that
    does not, a pass of ten copies yields the one token a plain pass would. So the copies verified are at most two
    more than the running average right (rounded down, as SatChain's adaptive k adds two to its average), copies
    are verified without a draft pass only while that average is at least one, and in place of the SAT drafts only
    while it is at least the drafts' average. Copies found but not verified are still scored against the tokens the
    iteration gave, so a text that starts repeating turns lookup back on. Before any copies are scored every copy
    is verified. The planner's replays (planner.py) use this same gate, so a plan prices the lookup a decode will do.
    """

    def __init__(self, max_tokens: int, k: int, open_always: bool = False):
        self.max_tokens, self.open_always = max_tokens, open_always  # open_always: every copy, as before the gate
        self.copies_right: float | None = None  # running average of copies right per lookup; None: none scored
        self.drafts_right = float(k)  # running average of SAT drafts accepted per verify pass

    def length(self) -> int:
        """How many copies to verify now."""
        if self.copies_right is None or self.open_always:
            return self.max_tokens
        return max(1, min(self.max_tokens, int(self.copies_right) + 2))

    def pays(self, direct: bool) -> bool:
        """Whether to verify copies: right after the bonus token (`direct`, no draft pass) or after t instead of
        the SAT drafts."""
        if self.copies_right is None or self.open_always:
            return True
        return self.copies_right >= (1.0 if direct else self.drafts_right)

    def saw_copies(self, right: float) -> None:
        self.copies_right = right if self.copies_right is None else (
            (1 - RECENT) * self.copies_right + RECENT * right)

    def saw_drafts(self, accepted: float) -> None:
        self.drafts_right = (1 - RECENT) * self.drafts_right + RECENT * accepted


def leading_matches(copies: list[int], produced: list[int]) -> int:
    """How many leading copies equal the tokens produced from the same place (at most the produced ones)."""
    return next((i for i, (c, p) in enumerate(zip(copies, produced)) if c != p), min(len(copies), len(produced)))


@dataclass
class DraftContext:
    """What a drafter may read and use for one iteration."""

    sat_model: SatModel
    chooser: TokenChooser
    cache: object  # the decoder's DynamicCache: a draft pass leaves the pending tokens in it, the SATs not
    pending: list[int]  # tokens not yet in the cache: the prompt, then each bonus token
    history: list[int]  # every token so far, prompt included
    room: int  # tokens that may still be emitted after the next one (copies beyond it are verified for nothing)
    clock: Clock


@dataclass(kw_only=True)
class Proposal:
    """Candidates for one verify pass."""

    kind: str  # what the iteration is (records.KINDS)
    start: int  # the verify pass's first token: t after a draft pass, else the pending bonus token
    k: int  # the drafts asked for: the draft pass's SATs, or the copies
    drafts: torch.Tensor  # (n,) the chain's drafts or copies; a tree's every node token
    q: torch.Tensor | None  # (n or depth, V) what the drafts were drawn from; None for copies (all mass on each)
    ranks: list[int] = field(default_factory=list)  # greedy SAT drafts: each one's rank in its q; a tree's nodes:
    # each one's rank, or under sampling its draw's order
    tree: DraftTree | None = None  # verify as a tree
    draws: torch.Tensor | None = None  # a tree: (depth, width) each depth's ranked draws (TokenChooser.draw_ranked)
    valid: list[int] = field(default_factory=list)  # a tree: per depth, how many of those draws are real
    draft_next: int = 0  # fused: the verify pass also runs this many SATs for the next iteration's drafts
    certain: list[int] = field(default_factory=list)  # [t] after a draft pass: emitted before the verified ones
    certain_probs: list[float] = field(default_factory=list)
    draft_pass_seconds: float | None = None  # None: no draft pass ran
    conditioned: bool = False  # a sampler head drafted: draft 1 conditioned on t (fused: on the bonus before the
    # drafts), draft j on draft j - 1

    @property
    def is_copy(self) -> bool:
        return self.kind.startswith("lookup")


class Drafter(Protocol):
    def propose(self, ctx: DraftContext) -> Proposal: ...

    def observe(self, proposal: Proposal, verdict: Verdict) -> None: ...


def draft_pass(ctx: DraftContext, k: int) -> tuple[int, float, torch.Tensor, float]:
    """Feed [pending, SAT x k]: returns t, p(t), q (k, V) and the pass's seconds. The pending tokens stay
    in the cache, the SATs leave it. With a sampler head, row j of q is conditioned on the first draw of
    row j - 1 (on t for row 1): `conditioned_draft_pass` gives those draws too."""
    t, p_t, q, _, seconds = conditioned_draft_pass(ctx, k)
    return t, p_t, q, seconds


def conditioned_draft_pass(ctx: DraftContext, k: int) -> tuple[int, float, torch.Tensor, torch.Tensor | None, float]:
    """`draft_pass`, plus the drafts (k,) the head drew, each conditioned on the one before it; None without
    a sampler head (then each SAT's q is its own, blind to t and to the drafts before it)."""
    sat_model, cache = ctx.sat_model, ctx.cache
    start, device = ctx.clock.now(), sat_model.device
    kv_before, n = cache.get_seq_length(), len(ctx.pending)
    ids = torch.tensor([ctx.pending + [0] * k], device=device)
    slots = torch.cat([torch.full((n,), -1, device=device), sat_model.sat_block(k)])[None]
    if not drafts_through_head(sat_model):
        hidden, logits = None, sat_model.forward(ids, slots, cache=cache, logits_to_keep=k + 1)[0]  # (1 + k, V)
    else:  # the head reads hidden states: logits = head(h)
        hidden = sat_model.hidden_states(ids, slots, cache=cache)[0, -(k + 1):]  # (1 + k, H)
        logits = sat_model.head(hidden)  # what forward's logits_to_keep=k + 1 computes
    rollback(cache, kv_before + n)
    t, p_t = ctx.chooser.choose(logits[:1])
    q, drafts = sat_drafts(ctx, logits[1:], None if hidden is None else hidden[1:], int(t[0]), ctx.history)
    return int(t[0]), float(p_t[0]), q, drafts, ctx.clock.now() - start


def drafts_through_head(sat_model: SatModel) -> bool:
    """Whether the SATs' drafts go through a sampler head: one beside the adapter, on a model whose logits are
    its plain head over the final hidden states (which the sampler head reads)."""
    return getattr(sat_model, "sampler", None) is not None and sat_model.plain_head


def sat_drafts(ctx: DraftContext, logits: torch.Tensor, hidden: torch.Tensor | None, t: int,
               history: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (k, V) for a run of k SATs whose logits (k, V) and, with a sampler head, final hidden states (k, H) a pass
    gave, t the token before draft 1 and `history` every token before t. With the head, also its drafts (k,), each
    conditioned on the one before it; without, each SAT's own q (blind to t and the drafts before) and None."""
    if hidden is None or not drafts_through_head(ctx.sat_model):
        return ctx.chooser.probs(logits), None
    model = ctx.sat_model.model
    return head_drafts(ctx.sat_model.sampler, hidden, logits, t, model.get_input_embeddings().weight,
                       model.get_output_embeddings().weight, ctx.chooser.probs, ctx.chooser.draw, history)


class SatChain:
    """k SAT drafts verified as a chain; k adapts to recent acceptance when `adaptive` (k is its bound)."""

    kind = "sat"

    def __init__(self, k: int, adaptive: bool = False):
        self.k_max, self.k, self.adaptive = k, k, adaptive
        self.recent = float(k)  # exponential average of accepted drafts

    def propose(self, ctx: DraftContext) -> Proposal:
        t, p_t, q, drafts, seconds = conditioned_draft_pass(ctx, self.k)
        proposal = self._candidates(ctx, t, q, drafts)
        proposal.certain, proposal.certain_probs, proposal.draft_pass_seconds = [t], [p_t], seconds
        proposal.conditioned = drafts is not None
        return proposal

    def _candidates(self, ctx: DraftContext, t: int, q: torch.Tensor, drafts: torch.Tensor | None) -> Proposal:
        drafts = ctx.chooser.draw(q) if drafts is None else drafts  # the head's draws: what each next row saw
        return Proposal(kind=self.kind, start=t, k=self.k, drafts=drafts, q=q, ranks=top_ranks(ctx, drafts))

    def observe(self, proposal: Proposal, verdict: Verdict) -> None:
        if self.adaptive and not proposal.is_copy:
            self.recent = (1 - RECENT) * self.recent + RECENT * verdict.accepted
            self.k = max(1, min(self.k_max, round(self.recent) + 2))


class SatTree(SatChain):
    """The chain's draft pass; the verify pass also checks `extra` runner-up candidates (sampled: more draws)."""

    kind = "tree"

    def __init__(self, k: int, extra: int, adaptive: bool = False):
        super().__init__(k, adaptive)
        self.extra = extra

    def _candidates(self, ctx: DraftContext, t: int, q: torch.Tensor, drafts: torch.Tensor | None) -> Proposal:
        # With a sampler head, depth j's q was conditioned on the head's draw at depth j - 1 (greedy: the top
        # one, so the chain's path). Fresh draws from those q are still exact: each depth's q was fixed before
        # its draws, whatever it was conditioned on; only off-path nodes are drafted from a less fitting q.
        tree = DraftTree.for_k(len(q), self.extra)
        draws, valid = ctx.chooser.draw_ranked(q, tree.width)
        return Proposal(kind=self.kind, start=t, k=self.k, drafts=tree.node_tokens(draws), q=q,
                        ranks=[path[-1] for path in tree.paths], tree=tree, draws=draws, valid=valid)


class PromptLookup:
    """Copies of what followed the last tokens' first earlier occurrence, else `sats`' drafts; `LookupGate` decides
    how many copies, and whether they are worth verifying."""

    def __init__(self, sats: SatChain, max_tokens: int, ngram: int, gated: bool = True):
        self.sats, self.max_tokens, self.ngram = sats, max_tokens, ngram
        self.gate = LookupGate(max_tokens, sats.k, open_always=not gated)
        self._unverified: tuple[list[int], bool] | None = None  # copies found but not verified: (copies, direct)

    def propose(self, ctx: DraftContext) -> Proposal:
        self._unverified = None
        # The bonus token may complete a recurring n-gram: verify its copies at once, without a draft pass.
        copies = self._copies(ctx.history, ctx.room) if len(ctx.pending) == 1 else []
        if copies and self.gate.pays(direct=True):
            return self._copy_proposal(ctx, "lookup_direct", ctx.pending[0], copies[:self.gate.length()])
        if copies:
            self._unverified = (copies, True)
        proposal = self.sats.propose(ctx)
        # The draft pass's t may complete one: its copies are then a better bet than the SAT drafts.
        copies = self._copies(ctx.history + proposal.certain, ctx.room - 1)
        if not copies:
            return proposal
        if not self.gate.pays(direct=False):
            self._unverified = (copies, False)
            return proposal
        after = self._copy_proposal(ctx, "lookup_after_draft", proposal.start, copies[:self.gate.length()])
        after.certain, after.certain_probs = proposal.certain, proposal.certain_probs
        after.draft_pass_seconds = proposal.draft_pass_seconds
        return after

    def observe(self, proposal: Proposal, verdict: Verdict) -> None:
        self.sats.observe(proposal, verdict)
        if proposal.is_copy:
            self.gate.saw_copies(verdict.accepted)
            return
        self.gate.saw_drafts(verdict.accepted)
        if self._unverified is not None:  # what the copies would have given: the tokens after where they start
            copies, direct = self._unverified
            produced = (proposal.certain if direct else []) + verdict.shown[:verdict.accepted] + [verdict.bonus]
            self.gate.saw_copies(leading_matches(copies, produced))

    def _copies(self, history: list[int], room: int) -> list[int]:
        return lookup_continuation(history, self.ngram, min(self.max_tokens, room)) if room > 0 else []

    @staticmethod
    def _copy_proposal(ctx: DraftContext, kind: str, start: int, copies: list[int]) -> Proposal:
        drafts = torch.tensor(copies, device=ctx.sat_model.device)
        return Proposal(kind=kind, start=start, k=len(copies), drafts=drafts, q=None)  # q: all mass on each copy


class Fused:
    """One draft pass first; then every verify pass also drafts the next k tokens (`verify_chain`)."""

    def __init__(self, k: int):
        self.k = k
        self.next: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the SAT run the last verify pass gave:
        # (logits, hidden states), its drafts still to choose once the bonus token is known

    def propose(self, ctx: DraftContext) -> Proposal:
        # The head's drafts after a verify pass run here, outside the pass's timing (the curve's fused price has them)
        if self.next is not None:  # the run drafts the tokens after the bonus (pending, the history's last token)
            q, drafts = sat_drafts(ctx, *self.next, ctx.pending[0], ctx.history[:-1])
            conditioned, drafts = drafts is not None, ctx.chooser.draw(q) if drafts is None else drafts
            return Proposal(kind="fused", start=ctx.pending[0], k=self.k, drafts=drafts, q=q, draft_next=self.k,
                            ranks=top_ranks(ctx, drafts), conditioned=conditioned)
        t, p_t, q, drafts, seconds = conditioned_draft_pass(ctx, self.k)
        conditioned, drafts = drafts is not None, ctx.chooser.draw(q) if drafts is None else drafts
        return Proposal(kind="fused", start=t, k=self.k, drafts=drafts, q=q, draft_next=self.k,
                        ranks=top_ranks(ctx, drafts), certain=[t], certain_probs=[p_t], draft_pass_seconds=seconds,
                        conditioned=conditioned)

    def observe(self, proposal: Proposal, verdict: Verdict) -> None:
        self.next = (verdict.next_logits, verdict.next_hidden)


def top_ranks(ctx: DraftContext, drafts: torch.Tensor) -> list[int]:
    """Greedy drafts are each SAT's top choice (rank 0); sampled drafts have no rank."""
    return [] if ctx.chooser.config.do_sample else [0] * len(drafts)


def drafter_for(config: DecodeConfig) -> Drafter:
    """The drafter a validated SDSAT config asks for."""
    if config.scheme == "fused":
        return Fused(config.k)
    adaptive = config.adaptive_k
    tree = config.tree_candidates
    sats = SatTree(config.k, tree, adaptive) if tree else SatChain(config.k, adaptive)
    return (PromptLookup(sats, config.lookup_tokens, config.lookup_ngram, config.lookup_gate) if config.lookup_tokens
            else sats)


def lookup_continuation(history: list[int], ngram: int, max_tokens: int) -> list[int]:
    """Prompt lookup: up to `max_tokens` tokens that followed the first occurrence of the longest recurring
    suffix of `history` (at least `ngram`, at most max(ngram, LOOKUP_LONGEST_NGRAM) tokens); [] if none.

    The first occurrence, as transformers' prompt lookup takes: in text that repeats with a short period
    the latest occurrence is followed by only a few tokens before the text ends.
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
