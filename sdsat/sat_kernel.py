"""One compiled call per adapted layer for the SAT rows' low-rank update of a draft pass on a CPU.

Decoding adds ``(x A) B`` (B already scaled) to the SAT rows of each adapted linear's output. As PyTorch ops
that is a cast, two small products and an add per layer, and inside a pass each such op costs about as much as
its setup, whatever its size: the 140 updates of the default adapter made a draft pass cost about a third more
than a plain pass as wide. This extension does the same arithmetic in one call (float32 products, the result
added into the output's dtype), a few hundred thousand multiply-adds on one thread.

It is compiled on the machine that runs it (``-march=native``, with torch's C++ extension loader, which needs
a C++ compiler and ninja) into the cache folder, keyed by its source, torch's version and the CPU, so another
machine sharing the folder builds its own. Compiling takes about half a minute on two cores: `start_build`
does it on a thread of its own, and until it is done (or where it cannot be built) the adapter keeps using
PyTorch's ops, which compute the same update to rounding. SAT rows need no bit-exactness (only the standard
rows, which this never touches). SDSAT_SAT_KERNEL=0 turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from .default_model import cache_dir

log = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <vector>

// out[n, :] += (x[n, :] @ a_t.T) @ b for each row n; a_t (R, I) (A transposed: each low-rank column's weights
// contiguous, so that x's dot product with it runs along memory) and b (R, O) float32, contiguous; x and out
// one dtype (float32 or bfloat16) with contiguous rows. The products accumulate in float32.
template <typename T>
static void update(T* out, int64_t out_stride, const T* x, int64_t x_stride, const float* a_t, const float* b,
                   int64_t rows, int64_t I, int64_t R, int64_t O) {
  std::vector<float> xf(I), low(R), acc(O);
  for (int64_t n = 0; n < rows; ++n) {
    const T* xn = x + n * x_stride;
    for (int64_t i = 0; i < I; ++i) xf[i] = static_cast<float>(xn[i]);
    for (int64_t r = 0; r < R; ++r) {
      const float* ar = a_t + r * I;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < I; ++i) sum += xf[i] * ar[i];
      low[r] = sum;
    }
    for (int64_t o = 0; o < O; ++o) acc[o] = 0.f;
    for (int64_t r = 0; r < R; ++r) {
      const float lr = low[r];
      const float* br = b + r * O;
#pragma omp simd
      for (int64_t o = 0; o < O; ++o) acc[o] += lr * br[o];
    }
    T* on = out + n * out_stride;
    for (int64_t o = 0; o < O; ++o) on[o] = static_cast<T>(static_cast<float>(on[o]) + acc[o]);
  }
}

// Adds the update to rows start.. of out (1, T, O) from the same rows of x (1, T, I); returns false, touching
// nothing, where this kernel does not apply (another device or dtype, rows not contiguous): the caller then
// computes the update with PyTorch's ops.
bool sat_update(torch::Tensor out, torch::Tensor x, int64_t start, torch::Tensor a_t, torch::Tensor b) {
  if (!out.is_cpu() || !x.is_cpu() || out.dim() != 3 || x.dim() != 3 || out.size(0) != 1 || x.size(0) != 1 ||
      out.stride(2) != 1 || x.stride(2) != 1 || out.scalar_type() != x.scalar_type() ||
      (out.scalar_type() != at::kFloat && out.scalar_type() != at::kBFloat16))
    return false;
  const int64_t rows = out.size(1) - start, I = x.size(2), R = a_t.size(0), O = b.size(1);
  TORCH_CHECK(a_t.is_contiguous() && b.is_contiguous() && a_t.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "sat_update: a_t and b must be contiguous float32");
  TORCH_CHECK(start >= 0 && rows >= 0 && x.size(1) == out.size(1) && a_t.size(1) == I && b.size(0) == R &&
              out.size(2) == O, "sat_update: shapes do not fit");
  if (out.scalar_type() == at::kBFloat16) {
    update(out.data_ptr<at::BFloat16>() + start * out.stride(1), out.stride(1),
           x.data_ptr<at::BFloat16>() + start * x.stride(1), x.stride(1),
           a_t.data_ptr<float>(), b.data_ptr<float>(), rows, I, R, O);
  } else {
    update(out.data_ptr<float>() + start * out.stride(1), out.stride(1),
           x.data_ptr<float>() + start * x.stride(1), x.stride(1),
           a_t.data_ptr<float>(), b.data_ptr<float>(), rows, I, R, O);
  }
  return true;
}
"""

_module = None  # the loaded extension, once built
_failed: str | None = None  # why it could not be built, once tried
_lock = threading.Lock()
_thread: threading.Thread | None = None


def enabled() -> bool:
    return os.environ.get("SDSAT_SAT_KERNEL", "1") != "0"


def compiled():
    """The extension, or None while it is not built, off, or unbuildable. `sat_update(out, x, start, a_t, b)` adds
    (x @ a_t.T) @ b to rows start.. of out in place: x (1, T, I) and out (1, T, O) of one dtype on the CPU, a_t
    (R, I) and b (R, O) float32; False (nothing done) where those do not hold."""
    return _module if enabled() else None


def build():
    """Compile (or load from the cache folder) and return the extension; None where it cannot be built (said
    once in the log) or while it is off. Safe to call from several threads: one builds, the others wait for it."""
    global _module, _failed
    if not enabled():
        return None
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        digest = hashlib.sha256("\n".join([SOURCE, torch.__version__, _cpu_key()]).encode()).hexdigest()[:16]
        folder = cache_dir() / "kernels" / f"sat_update-{digest}"
        try:
            from torch.utils.cpp_extension import load_inline

            folder.mkdir(parents=True, exist_ok=True)
            _put_on_path(Path(sys.executable).parent)  # pip's ninja, where the environment is not activated
            _module = load_inline(f"sdsat_sat_update_{digest}", cpp_sources=SOURCE, functions=["sat_update"],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                                  build_directory=str(folder), verbose=False)
        except Exception as err:  # no compiler, no ninja, a read-only cache: PyTorch's ops do the same work
            _failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            log.info("the SAT rows' compiled update is not available here (%s); using PyTorch's ops", _failed)
        return _module


def start_build() -> None:
    """`build` on a daemon thread, once per process, unless it is off or done."""
    global _thread
    if not enabled() or _module is not None or _failed is not None or _thread is not None:
        return
    _thread = threading.Thread(target=build, name="sdsat-sat-kernel-build", daemon=True)
    _thread.start()


def _put_on_path(folder: Path) -> None:
    """Let subprocesses (torch's build runs `ninja`) find the programs in `folder`."""
    path = os.environ.get("PATH", "")
    if str(folder) not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([str(folder), path]) if path else str(folder)


def _cpu_key() -> str:
    """What `-march=native` compiles for: the CPU's model name and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        import platform

        return platform.processor() or platform.machine()
