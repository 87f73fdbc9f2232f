"""The machine a figure was measured on, described once: the benchmark records it, the page shows it.

Speed-ups depend on the processor (the cost of a pass over a few tokens against one), so every
description names the CPU model and the instruction-set features that change which kernels are fast.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# CPU flags that decide which matrix kernels are fast (AMX and AVX-512 BF16 make bf16 products cheap).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """The processor's model name (what a kernel plan, and every timing, depends on)."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def machine_is_quiet(per_core: float = 0.25) -> bool:
    """Whether the cores are free to measure on: a one-minute load average under `per_core` per core (on a
    shared host that reports the host's load, it may never be)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not reported here
        return True
    return load < per_core * (os.cpu_count() or 1)


def cpu_flags() -> list[str]:
    """Of KERNEL_FLAGS, those this processor has."""
    flags = set(_cpuinfo().get("flags", "").split())
    return [f for f in KERNEL_FLAGS if f in flags]


def describe(model: torch.nn.Module) -> dict:
    """Where and in which precision `model` runs, with the processor it runs on."""
    param = next(model.parameters())
    info = {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
    }
    if param.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(param.device)
    return info


def hardware_line(model: torch.nn.Module) -> str:
    """One line for the page, e.g. "AMD EPYC (avx512_bf16), 2 cores, 2 torch threads · float32"."""
    info = describe(model)
    if "gpu" in info:
        return f"{info['gpu']} · {info['dtype']}"
    flags = f" ({', '.join(f for f in info['cpu_flags'] if f.startswith(('amx', 'avx512_bf16')))})"
    return (f"{info['cpu']}{flags if flags != ' ()' else ''}, {info['cores_available']} cores, "
            f"{info['torch_threads']} torch threads · {info['dtype']}")
