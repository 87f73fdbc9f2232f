"""Where SAT runs stand in a block: the attention mask and positions shared by training and decoding.

The standard tokens of a block come first, every SAT run after them. Order does not matter because
the attention mask and the position ids say who sees whom and where each token stands:
  * standard tokens: ordinary causal attention among themselves, never a SAT;
  * SAT j of a run anchored at standard token p: sees standard tokens 0..p and SATs 0..j of its
    own run, and stands at position p+1+j, where it predicts what the token at p+1+j would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SatLayout:
    """Where the SAT runs go in a batch of N-token sequences (T = N + number of SATs)."""

    n: int  # standard tokens per sequence
    anchor: torch.Tensor  # (M,) p: the last standard position each SAT may see
    slot: torch.Tensor  # (M,) j: the SAT's index within its run
    run: torch.Tensor  # (M,) which run the SAT belongs to

    @classmethod
    def runs_at(cls, n: int, anchors: torch.Tensor, length: int) -> "SatLayout":
        """One run of `length` SATs anchored at each of `anchors` (standard positions < n)."""
        runs = len(anchors)
        return cls(n=n, anchor=anchors.repeat_interleave(length), slot=torch.arange(length).repeat(runs),
                   run=torch.arange(runs).repeat_interleave(length))

    @property
    def num_sats(self) -> int:
        return int(self.slot.numel())

    @property
    def position_ids(self) -> torch.Tensor:
        """(1, T): standard tokens at 0..N-1, SAT j of a run after p at p+1+j."""
        return torch.cat([torch.arange(self.n), self.anchor + 1 + self.slot])[None]

    @property
    def sat_slots(self) -> torch.Tensor:
        """(1, T): -1 for standard tokens, j for SATs."""
        return torch.cat([torch.full((self.n,), -1), self.slot])[None]

    @property
    def target_positions(self) -> torch.Tensor:
        """(M,) the standard position whose next-token prediction each SAT must match: p+1+j."""
        return self.anchor + 1 + self.slot

    def attention_mask(self) -> torch.Tensor:
        """(1, 1, T, T) boolean mask, True where attention is allowed."""
        n, m = self.n, self.num_sats
        allow = torch.zeros(n + m, n + m, dtype=torch.bool)
        allow[:n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        allow[n:, :n] = torch.arange(n)[None, :] <= self.anchor[:, None]
        allow[n:, n:] = (self.run[:, None] == self.run[None, :]) & (self.slot[None, :] <= self.slot[:, None])
        return allow[None, None]
