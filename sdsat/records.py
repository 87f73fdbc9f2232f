"""What a decoder reports: one `StepRecord` per iteration, then one `GenerationResult`.

Records say what happened in so many words (`kind`, `draft_pass`), so the readers (the page, the
CLI, the benchmark) never have to infer it from counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterator

# What an iteration did, as `StepRecord.kind`:
KINDS = (
    "vanilla",  # one forward pass, one token
    "sat",  # draft pass [c, SAT x k] -> t and k drafts; verify pass [t, drafts] (the paper)
    "tree",  # as "sat", and the verify pass also checks the SATs' runner-up candidates (tree.py)
    "lookup_direct",  # prompt-lookup copies verified right after the bonus token: one pass, no draft pass
    "lookup_after_draft",  # a draft pass gave t, which completed a recurring n-gram: its copies are verified
    "fused",  # one pass verifies the drafts and drafts the next block (the first iteration also drafts first)
)


@dataclass
class AcceptTest:
    """One sampled draft's accept test, with the run's own numbers (the step explorer shows them).

    At a position, sibling drafts are tried in the order they were drawn: the first against p, each later
    one against the residual the rejections before it left (sampling.py).
    """

    depth: int  # the draft's position after t (1: the first draft)
    token: int
    p: float  # the target's probability of the token at this try: p, or the residual after earlier siblings
    q: float  # the probability it was drawn with: q, less the siblings drawn before it (1 for a copy)
    u: float  # the uniform number drawn; the draft is accepted when u < min(1, p / q)
    accepted: bool
    residual: list[tuple[int, float]] = field(default_factory=list)  # on rejection: norm(max(0, p - q))'s top tokens
    replacement: int | None = None  # the last rejection at a position: the token drawn from that residual
    rank: int = 0  # its place among its depth's draws (0: the first drawn; a copy's is 0)

    @property
    def ratio(self) -> float:
        return min(1.0, self.p / self.q) if self.q > 0 else 0.0


@dataclass(kw_only=True)
class StepRecord:
    """One iteration."""

    index: int  # iteration number, from 0
    kind: str  # one of KINDS
    kv_len_before: int  # tokens in the cache when the iteration started
    draft_pass: bool  # a draft pass ran (it gave the token t, source "verified"); its time is pass_seconds[0]
    k: int  # drafts asked for: the SATs of the draft pass, or the copies verified (0 for vanilla)
    drafts: list[int]  # d_1..d_k from the SATs, or the copies prompt lookup verified; with a draft tree, the
    # path the verification walked (shorter than k when it ended in a runner-up without children)
    draft_probs: list[float]  # q(d_i): the SAT's probability of its own draft (1.0 for a copy)
    predictions: list[int]  # argmax of the model after t, d_1, ..., d_k (what verification compared)
    accepted: int  # drafts accepted (a prefix of `drafts`)
    tokens: list[int]  # tokens emitted this iteration, in order (cut where decoding stops)
    sources: list[str]  # per emitted token: "verified" (step 1), "draft" (accepted) or "bonus" (step 2)
    probs: list[float]  # per emitted token: the model's probability p of it
    pass_seconds: list[float]  # wall time of each forward pass this iteration: [draft pass,] verify pass
    kv_len: int  # tokens in the cache after the iteration
    elapsed: float  # seconds since the request started, at the end of this iteration
    draft_ranks: list[int] = field(default_factory=list)  # greedy SAT drafts: each one's rank in its q (0: the
    # top choice; a draft tree also verifies runner-ups); empty for copies and sampled drafts
    candidates: int = 0  # drafted tokens the verify pass checked: k, the copies, or every node of a draft tree
    tree_paths: list[list[int]] = field(default_factory=list)  # a draft tree's nodes as rank paths (tree.py)
    tree_tokens: list[int] = field(default_factory=list)  # the token of each of those nodes
    accept_tests: list[AcceptTest] = field(default_factory=list)  # sampling: every draft tried, in order
    conditioned: bool = False  # a sampler head drafted: draft 1 conditioned on t (a fused iteration: on the bonus
    # before it), draft j on draft j - 1 (head.py)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StepRecord.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def draft_source(self) -> str:
        """Where the drafts came from: "sat", "lookup" (prompt-lookup copies) or "" (vanilla)."""
        return "" if self.kind == "vanilla" else "lookup" if self.kind.startswith("lookup") else "sat"

    @property
    def rejected(self) -> list[int]:
        return self.drafts[self.accepted:]

    @property
    def forward_passes(self) -> int:
        return len(self.pass_seconds)

    @property
    def draft_pass_seconds(self) -> float | None:
        return self.pass_seconds[0] if self.draft_pass else None

    @property
    def verify_pass_seconds(self) -> float:
        """The iteration's last pass: the verify pass (vanilla's only pass)."""
        return self.pass_seconds[-1]

    def to_dict(self) -> dict:
        return asdict(self) | {"rejected": self.rejected, "draft_source": self.draft_source}


@dataclass(kw_only=True)
class GenerationResult:
    """The whole generation, with the metrics of SDSAT.md."""

    method: str
    k: int  # 0 for vanilla
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str  # new tokens decoded, special tokens skipped
    seconds: float  # wall time of the request, prefill included
    prefill_seconds: float  # wall time of the first forward pass
    stop_reason: str  # "eos", "max_new_tokens", "stop_string" or "cancelled"
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
        return self.summary() | {"prompt_ids": self.prompt_ids, "token_ids": self.token_ids, "text": self.text,
                                 "prefill_seconds": self.prefill_seconds,
                                 "steps": [s.to_dict() for s in self.steps]}


Event = StepRecord | GenerationResult


def collect(events: Iterator[Event]) -> GenerationResult:
    """Drain a decoder's events and return its result."""
    for event in events:
        if isinstance(event, GenerationResult):
            return event
    raise RuntimeError("decoder ended without a result")
