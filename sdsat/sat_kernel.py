"""One compiled call per adapted layer for the SAT rows' low-rank update of a draft pass on a CPU.

Decoding adds ``(x A) B`` times the LoRA scale to the SAT rows of each adapted linear's output. As PyTorch ops
that is a cast, two small products and an add per layer, and inside a pass each such op costs about as much as
its setup, whatever its size: the 140 updates of the default adapter made a draft pass cost about a third more
than a plain pass as wide. This extension does the same arithmetic in one call (float32 products, the result
added into the output's dtype), a few hundred thousand multiply-adds on one thread.

The C++ is `csrc/sat_update.cpp`, compiled on the machine that runs it (`native.py`). Until it is built (or
where it cannot be) the adapter keeps using PyTorch's ops, which compute the same update to rounding: SAT rows
need no bit-exactness (only the standard rows, which this never touches). SDSAT_SAT_KERNEL=0 turns it off.
"""

from __future__ import annotations

import os

from . import native


def enabled() -> bool:
    return os.environ.get("SDSAT_SAT_KERNEL", "1") != "0"


def compiled():
    """The extension, or None while it is not built, off, or unbuildable. `sat_update(out, x, start, a, b, scale)`
    adds scale * (x @ a) @ b to rows start.. of out in place: x (1, T, I) and out (1, T, O) of one dtype on the CPU,
    a (I, R) and b (R, O) contiguous, both float32 or both bfloat16; False (nothing done) where those do not hold."""
    return native.module() if enabled() else None


def build():
    """The extension (built now where it is not yet: native.build), or None where it cannot be built or is off."""
    return native.build() if enabled() else None


def start_build() -> None:
    """native.start_build, unless the update is off."""
    if enabled():
        native.start_build()
