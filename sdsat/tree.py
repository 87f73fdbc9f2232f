"""Draft trees: verify the SATs' runner-up candidates beside their top drafts, in the same pass.

A SAT drafts a distribution q_j for the token j + 1 places after t; the chain verifies only the top
token of each. Where a pass over a few more tokens costs little more (a GPU, and CPUs whose small
products are bound by overheads rather than arithmetic: measure with `python -m sdsat.bench.pass_cost`),
a few more candidates ride along almost for free. A tree is a set of rank paths, as in Medusa: \
(0, 1) is the SAT's second choice at
depth 2 placed after its first choice at depth 1. Every candidate sees t, its ancestors and itself,
and stands at its depth. Greedy verification walks down from t, taking the child that equals the
model's own next token; the result is exactly greedy decoding. Under sampling, a rank is a draw:
each depth's candidates are drawn from its q without replacement, and verification tries a node's
children in the order drawn, by multi-draft rejection sampling (verify.py), which keeps the output
distribution that of sampling from the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Extra candidates in the order they are added, most likely to be accepted first: a SAT's second
# choice near the root is taken far more often than third choices or deeper branches
# (docs/architecture.md gives the measured shares).
RUNNER_UPS: tuple[tuple[int, ...], ...] = ((1,), (0, 1), (2,), (1, 0), (0, 0, 1), (3,), (0, 2), (1, 1))
MAX_EXTRA = len(RUNNER_UPS)


@dataclass(frozen=True)
class DraftTree:
    """Candidate nodes as rank paths, parents listed before their children; the chain comes first."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    @functools.lru_cache(maxsize=64)
    def for_k(cls, k: int, extra: int) -> "DraftTree":
        """The chain of k top drafts plus the first `extra` runner-ups that fit within depth k."""
        if not 0 <= extra <= MAX_EXTRA:
            raise ValueError(f"tree_candidates must be between 0 and {MAX_EXTRA}, got {extra}")
        chain = tuple((0,) * d for d in range(1, k + 1))
        fitting = [p for p in RUNNER_UPS if len(p) <= k]
        return cls(chain + tuple(fitting[:extra]))

    def __post_init__(self) -> None:
        seen: set[tuple[int, ...]] = set()
        for path in self.paths:
            if not path or min(path) < 0 or (len(path) > 1 and path[:-1] not in seen) or path in seen:
                raise ValueError(f"tree path {path} needs its parent listed before it, once")
            seen.add(path)

    @functools.cached_property
    def parents(self) -> list[int]:
        """Per node, its parent's node index, or -1 for children of t."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    @functools.cached_property
    def children(self) -> dict[int, list[int]]:
        """Per node index (-1 for t), its children's node indices by rank: the order sampled siblings are
        tried in."""
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(i)
        return {node: sorted(kids, key=lambda c: self.paths[c][-1]) for node, kids in children.items()}

    @functools.cached_property
    def width(self) -> int:
        """Draws needed per depth: the highest rank in any path, plus one."""
        return max(max(p) for p in self.paths) + 1

    def node_tokens(self, draws: torch.Tensor) -> torch.Tensor:
        """(depth, width) ranked draws -> the node tokens (n,): node (r_1..r_j) takes draw r_j of depth j.

        Nodes of one depth share its draws whatever their parents: only one node per depth is ever
        reached, so each reached node's children are a true draw of its depth's distribution."""
        depths = torch.tensor([len(p) - 1 for p in self.paths], device=draws.device)
        ranks = torch.tensor([p[-1] for p in self.paths], device=draws.device)
        return draws[depths, ranks]

    @functools.cached_property
    def attention_mask(self) -> torch.Tensor:
        """(1, 1, 1 + n, 1 + n) over the block [t, nodes]: each node sees t, its ancestors and itself."""
        n, parents = len(self.paths), self.parents
        allow = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allow[:, 0] = True
        for i in range(n):
            j = i
            while j >= 0:
                allow[i + 1, j + 1] = True
                j = parents[j]
        return allow[None, None]

    @functools.cached_property
    def position_offsets(self) -> torch.Tensor:
        """(1, 1 + n): t at 0, each node at its depth."""
        return torch.tensor([[0] + [len(p) for p in self.paths]])

    def walk(self, predictions: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
        """Greedy verification; predictions are the model's argmax at [t, nodes], tokens the node tokens.

        Returns the accepted nodes (a path from t) and the path shown for them: the accepted nodes, then
        the first-ranked child at each level below, down to a leaf (the draft the model turned down first).
        """
        children = self.children
        accepted, node = [], -1
        while True:
            want = predictions[node + 1]
            nxt = next((c for c in children.get(node, []) if tokens[c] == want), None)
            if nxt is None:
                break
            accepted.append(nxt)
            node = nxt
        return accepted, self.shown(accepted)

    def shown(self, accepted: list[int]) -> list[int]:
        """The path a record shows for these accepted nodes: them, then the first-ranked child at each level
        below, down to a leaf (the draft turned down first)."""
        shown, node = list(accepted), accepted[-1] if accepted else -1
        while self.children.get(node):
            node = self.children[node][0]
            shown.append(node)
        return shown
