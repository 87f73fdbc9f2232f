"""The precision batched work runs fastest in on this machine, measured: the corpus's generation and the head's
feature extraction run the model over whole batches for hours, and which of float32 and bfloat16 is faster for
that depends on the CPU (its bfloat16 matrix units, or their absence), so `--dtype auto` times both here.

A GPU takes bfloat16 without a measurement. Decoding makes its own choice (`sdsat.tuning`): one token at a
time is another workload.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

log = logging.getLogger(__name__)

CANDIDATES = ("float32", "bfloat16")


@torch.inference_mode()
def forward_seconds(model: torch.nn.Module, batch: int, length: int, repeats: int) -> float:
    """The fastest of `repeats` forward passes of the model over a (batch, length) block, after one warm-up."""
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    model(input_ids=ids)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        model(input_ids=ids)
        best = min(best, time.perf_counter() - began)
    return best


def fastest_batched_dtype(model: torch.nn.Module, batch: int = 8, length: int = 64, repeats: int = 1
                          ) -> tuple[str, dict[str, float]]:
    """The faster of float32 and bfloat16 for `model` (loaded in float32, left as it is) over a batch, and the
    seconds each took; bfloat16 on a GPU, unmeasured."""
    if next(model.parameters()).device.type == "cuda":
        return "bfloat16", {}
    seconds = {}
    for name in CANDIDATES:
        trial = model if name == "float32" else copy.deepcopy(model).to(getattr(torch, name))
        seconds[name] = round(forward_seconds(trial, batch, length, repeats), 4)
    return min(seconds, key=seconds.get), seconds


def resolve_batched_dtype(dtype: str, model_id: str) -> str:
    """`dtype` itself, or for "auto" the faster one on this machine (`fastest_batched_dtype`), logged."""
    if dtype != "auto":
        return dtype
    from ..models import LoadConfig, load_model

    model, _ = load_model(LoadConfig(model=model_id, dtype="float32", cpu_kernels=False))
    chosen, seconds = fastest_batched_dtype(model)
    log.info("batched work in %s on this machine (a forward over a batch: %s)", chosen,
             ", ".join(f"{name} {s:.3f} s" for name, s in seconds.items()) or "a GPU")
    return chosen
