"""Training examples the SDSAT way: runs of adaptive tokens inserted into a sequence.

A run inserted after position p stands at positions p+1 .. p+L, and its j-th SAT (j from 0) must
predict the token at p+j+2 — what the standard token at p+j+1 predicts (paper, section 3.2). The
decoder asks exactly this: after the last cached token c at p, SAT j drafts the token j+1 places
after the certain token t at p+1.

Layout: the N standard tokens come first, every SAT run after them. Order does not matter because
the attention mask and the position ids say who sees whom and where each token stands:
  * standard tokens: ordinary causal attention among themselves, positions 0..N-1, never a SAT;
  * SAT j of a run after p: sees standard tokens 0..p and SATs 0..j of its own run, position p+1+j.
Every run in a batch shares one layout, so one (1, 1, T, T) mask serves the whole batch.
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


def sample_layout(n: int, runs: int, run_length: int, generator: torch.Generator, min_run_length: int | None = None) -> SatLayout:
    """Pick `runs` distinct insertion points in an N-token sequence.

    A run after p needs the label at p+L+1 <= N-1, so p <= N-3 and L <= N-2-p. Run lengths are
    drawn from min_run_length..run_length; full-length runs are the default because SAT j only ever
    sees SATs before it, so a shorter run is a prefix of a longer one and trains nothing new.
    """
    if n < 3:
        raise ValueError(f"sequences need at least 3 tokens to train SATs, got {n}")
    runs = min(runs, n - 2)
    anchors = torch.randperm(n - 2, generator=generator)[:runs].sort().values
    lo = min_run_length or run_length
    lengths = torch.randint(lo, run_length + 1, (runs,), generator=generator)
    lengths = torch.minimum(lengths, n - 2 - anchors)
    run_ids = torch.repeat_interleave(torch.arange(runs), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    slot = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    return SatLayout(n=n, anchor=anchors[run_ids], slot=slot, run=run_ids)
