"""One generation request: `DecodeConfig`, the only place where decoding settings and their ranges are
checked. The CLI, the page and the benchmark fill it in from named values and call `validate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import check_choice, check_whole
from .sampling import SamplingConfig
from .tree import MAX_EXTRA as MAX_TREE_CANDIDATES

METHODS = ("vanilla", "sdsat")
SCHEMES = ("two_step", "fused")
MAX_LOOKUP_TOKENS = 64  # the most copies one iteration may verify
MAX_LOOKUP_NGRAM = 8


@dataclass
class DecodeConfig:
    """One generation request (fields in this order for positional callers)."""

    method: str = "sdsat"  # "sdsat" (draft-then-verify) or "vanilla" (one token per forward pass)
    k: int = 3  # adaptive tokens (drafts) per SDSAT step, 1..the SAT spec's max_k
    max_new_tokens: int = 128  # stop after this many new tokens
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # greedy unless do_sample
    stop_strings: list[str] = field(default_factory=list)  # stop once the output contains one
    scheme: str = "two_step"  # SDSAT: "two_step" (the paper: draft pass, then verify pass) or "fused"
    adaptive_k: bool = False  # SDSAT two_step: shrink / grow k from recent acceptance (k is the upper bound)
    lookup_tokens: int = 0  # SDSAT two_step: when the last tokens recur, verify up to this many tokens
    # copied from after that occurrence instead of SAT drafts (prompt lookup, drafters.py); 0: off
    lookup_ngram: int = 2  # at least this many last tokens must recur (1 is too weak a hint on chat text)
    tree_candidates: int = 0  # SDSAT two_step: also verify this many of the SATs' runner-up candidates (greedy)
    # or further draws (sampling) in the verify pass: a draft tree, tree.py; 0: the chain (the paper)
    lookup_gate: bool = True  # prompt lookup verifies copies only while they pay (drafters.LookupGate); False:
    # every copy found, up to lookup_tokens (what the acceptance trace measures copies' pass rates with)

    @property
    def draft_positions(self) -> int:
        """Positions past the output that a decoder may feed: vanilla none; SDSAT's last verify pass holds
        k drafts, and the fused scheme's SAT runs reach 2k past the bonus token."""
        if self.method == "vanilla":
            return 0
        return self.k * (2 if self.scheme == "fused" else 1)

    def prompt_room(self, max_context: int) -> int:
        """The longest prompt that leaves room in `max_context` for the new tokens and the draft positions."""
        return max_context - self.max_new_tokens - self.draft_positions

    def validate(self, max_k: int | None = None, max_new_tokens_limit: int = 100_000) -> None:
        """Raise ValueError naming the first setting out of its range (or a combination that does not work)."""
        check_choice("method", self.method, METHODS)
        check_whole("max_new_tokens", self.max_new_tokens, 1, max_new_tokens_limit)
        check_choice("scheme", self.scheme, SCHEMES)
        if self.method == "sdsat":
            if max_k is None:
                raise ValueError("SDSAT decoding needs a model with adaptive tokens (a SAT spec or adapter)")
            check_whole("k (number of adaptive tokens)", self.k, 1, max_k)
            check_whole("lookup_tokens", self.lookup_tokens, 0, MAX_LOOKUP_TOKENS, off=True)
            check_whole("tree_candidates", self.tree_candidates, 0, MAX_TREE_CANDIDATES, off=True)
            check_whole("lookup_ngram", self.lookup_ngram, 1, MAX_LOOKUP_NGRAM)
            for name in ("lookup_tokens", "tree_candidates"):
                if getattr(self, name) and self.scheme != "two_step":
                    raise ValueError(f"{name} works with the two_step scheme only")
        self.sampling.validate()

    def check_context(self, prompt_len: int, max_context: int | None) -> None:
        """Refuse a request whose positions would run past the model's context (None: no known limit)."""
        if not isinstance(max_context, int) or max_context <= 0:
            return
        drafts = self.draft_positions
        extra = f" plus k ({drafts} draft positions)" if drafts else ""
        if prompt_len + drafts >= max_context:
            raise ValueError(f"the prompt has {prompt_len} tokens{extra}, but the model's context is {max_context} "
                             "tokens: shorten the prompt")
        if prompt_len > self.prompt_room(max_context):
            raise ValueError(f"prompt ({prompt_len} tokens) plus max_new_tokens ({self.max_new_tokens}){extra} must "
                             f"fit the model's context of {max_context} tokens: max_new_tokens can be at most "
                             f"{max_context - prompt_len - drafts} for this prompt")

