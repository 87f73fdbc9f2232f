"""ZeroGPU, the shared GPUs of Hugging Face Spaces, through the `spaces` package.

What the page relies on, read in the source of `spaces` 0.51 (`spaces/zero/decorator.py`,
`spaces/config.py`, `spaces/zero/wrappers.py`, `spaces/zero/__init__.py`):
- `spaces.GPU(fn, duration=s)` returns `fn` itself unless the environment variable SPACES_ZERO_GPU
  is true: local runs, CPU Spaces, GPU Spaces and the tests call the plain function.
- On ZeroGPU it wraps plain functions and generator functions; it refuses coroutine functions
  (NotImplementedError). So the decorated work is synchronous, and the async /generate handler
  awaits it in a worker thread.
- The wrapped call runs in a process forked for it, with a GPU attached: its arguments and every
  value it returns or yields are pickled across, and a `threading.Event` set by the caller does not
  reach it (the GPU task runs until it finishes or its booked duration ends).
- Weights must be on CUDA at import ("packed" at start-up, moved onto the GPU in each fork); no
  CUDA work may run outside a decorated function. `spaces` must be imported before CUDA starts.
- `duration` is the GPU time booked per call, in seconds.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def on_zero_gpu() -> bool:
    """True on a ZeroGPU Space (as `spaces.config` reads it)."""
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def cancel_args(cancel: threading.Event) -> tuple:
    """(cancel,) to pass a decorated call, or () on ZeroGPU, where an Event cannot reach its process
    (the GPU task then runs until it ends or its booked time does)."""
    return () if on_zero_gpu() else (cancel,)


def gpu(fn: F, duration: int) -> F:
    """`fn` booked on a ZeroGPU GPU for `duration` seconds per call; `fn` unchanged elsewhere."""
    import spaces

    return spaces.GPU(fn, duration=duration)
