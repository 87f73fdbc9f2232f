"""Training examples the SDSAT way: runs of adaptive tokens inserted into a sequence.

A run inserted after position p stands at positions p+1 .. p+L, and its j-th SAT (j from 0) must
predict the token at p+j+2 — what the standard token at p+j+1 predicts (paper, section 3.2). The
decoder asks exactly this: after the last cached token c at p, SAT j drafts the token j+1 places
after the certain token t at p+1.

The layout (sdsat/layout.py) puts the N standard tokens first and every SAT run after them. Every
sequence in a batch shares one layout, so one (1, 1, T, T) mask serves the whole batch.
"""

from __future__ import annotations

import torch

from ..layout import SatLayout


def sample_layout(n: int, runs: int, run_length: int, generator: torch.Generator,
                  min_run_length: int | None = None) -> SatLayout:
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
