"""The project's C++ kernels for the CPU (sdsat/csrc), compiled on the machine that runs them.

Four kernels share one extension: the SAT rows' low-rank update (`sat_kernel.py`), the compiled form's
attention (`attention.py`), a row-invariant matrix product (`cpu_kernels.py`) and the sampler head's per-draft
scores (`head.py`). The update, the attention and the head's scores are small arithmetic where PyTorch's per-op setup
costs more than the work; the product reads bfloat16 weights where oneDNN cannot.
They are compiled with `-march=native` by torch's C++ extension loader (which needs a C++ compiler and ninja)
into the cache folder, keyed by the sources, torch's version and the CPU, so another machine sharing the folder
builds its own. Compiling takes about half a minute on two cores, so it never sits on a first start's path:
`start_build` runs it on a thread of its own, and the tuner (itself in the background) waits for it. Where it
cannot be built, each caller keeps its PyTorch path, and the failure is said once in the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from .default_model import cache_dir

log = logging.getLogger(__name__)

# compiled as one unit, in this order
SOURCES = ("vectors.h", "sat_update.cpp", "attend.cpp", "linear.cpp", "head_score.cpp", "bindings.cpp")
# OpenMP: ATen's parallel_for is inline and runs its loop on one thread unless compiled with it; the library links
# by soname to the libgomp torch has loaded, so the kernels share torch's threads and their count
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

STALE_LOCK_SECONDS = 15 * 60  # a build takes a minute or a few: a lock file this old was left by a killed one
_module = None  # the loaded extension, once built
_failed: str | None = None  # why it could not be built, once tried
_lock = threading.Lock()
_thread: threading.Thread | None = None


def module():
    """The extension, or None while it is not built (or cannot be)."""
    return _module


def build():
    """Compile (or load from the cache folder) and return the extension; None where it cannot be built (said
    once in the log). Safe to call from several threads: one builds, the others wait for it."""
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        digest, sources = _digest()
        name, folder = f"sdsat_native_{digest}", _folder(digest)
        try:
            if _drop_stale_lock(folder / "lock"):
                (folder / f"{name}.so").unlink(missing_ok=True)  # maybe half written: built again
            # built before: imported as it is (no ninja needed); while another process builds it (torch's lock file
            # is there, the library maybe half written), torch's loader waits for that build
            if (folder / f"{name}.so").is_file() and not (folder / "lock").exists():
                _module = _import(name, folder / f"{name}.so")
            else:
                from torch.utils.cpp_extension import load_inline

                folder.mkdir(parents=True, exist_ok=True)
                _put_on_path(Path(sys.executable).parent)  # pip's ninja, where the environment is not activated
                _module = load_inline(name, cpp_sources=sources, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                      build_directory=str(folder), verbose=False)
        except Exception as err:  # no compiler, no ninja, a read-only cache: the callers' PyTorch paths remain
            _failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            log.info("the compiled kernels are not available here (%s); using PyTorch's ops", _failed)
        return _module


def _drop_stale_lock(lock: Path) -> bool:
    """Remove the lock file of a build that was killed (a process stopped mid-build leaves it, and torch's loader
    would wait for it for ever): one older than any build takes. True where one was removed."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
            log.warning("removed %s, left by a build of the compiled kernels that did not finish", lock)
            return True
    except OSError:  # no lock, or another process removed it first
        pass
    return False


def built() -> bool:
    """Whether the extension is loaded, or compiled for this machine in the cache folder (loading it then takes
    a fraction of a second): what a tuning measured with it needs, checked without building."""
    if _module is not None:
        return True
    if _failed is not None:
        return False
    digest, _ = _digest()
    return (_folder(digest) / f"sdsat_native_{digest}.so").is_file()


def digest() -> str | None:
    """What the extension is built from (sources, flags, torch, CPU), where it is built; else None: a tuning
    measured with one build of the kernels is not another's."""
    return _digest()[0] if built() else None


def _import(name: str, path: Path):
    """A compiled extension from its file (torch is imported already, so its libraries resolve)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def start_build() -> None:
    """`build` on a daemon thread, once per process, unless it is done."""
    global _thread
    if _module is not None or _failed is not None or _thread is not None:
        return
    _thread = threading.Thread(target=build, name="sdsat-native-build", daemon=True)
    _thread.start()


@functools.lru_cache(maxsize=1)
def _digest() -> tuple[str, list[str]]:
    folder = Path(__file__).resolve().parent / "csrc"
    sources = [(folder / name).read_text() for name in SOURCES]
    key = "\n".join([*sources, " ".join(CFLAGS + LDFLAGS), torch.__version__, _cpu_key()])
    return hashlib.sha256(key.encode()).hexdigest()[:16], sources


def _folder(digest: str) -> Path:
    return cache_dir() / "kernels" / f"native-{digest}"


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
