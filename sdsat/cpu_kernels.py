"""Faster small-batch matrix products on a CPU, chosen by measurement when a model loads.

A decoder multiplies every weight matrix by 1 row (vanilla), or by a handful of rows (speculative
passes). On CPUs the BLAS kernel that `nn.Linear` reaches for a few rows can be far from the best:
MKL may take a generic path on processors it does not recognise (AMD's among them), while oneDNN
dispatches on the instruction set, and a weight stored once in oneDNN's blocked layout is not
repacked on every call (figures per machine: docs/architecture.md, "CPU kernels"). Which form wins
depends on the matrix shape, the row count and the machine, so
`tune` times the equivalent forms for every distinct weight shape and row count 1..max_rows on the
model's own weights (cycling through all layers, so the weights come from memory as in a real pass),
and `install` routes each product to the fastest. Results agree with `nn.Linear` to float rounding;
wider blocks and gradients use `nn.Linear` as is.

The row-invariant form (`invariant_plan`), where a row's product has the same bits alone and in any block, has two
kernels: oneDNN's blocked products in chunks, and the project's own (csrc/linear.cpp, compiled by native.py), which
also runs bfloat16 weights on CPUs where oneDNN has no bfloat16 kernel. Where both run, the faster on the model's
own weights is chosen once per machine and kept.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import jsonfile, native, timing
from .hardware import cpu_name

# x W^T as F.linear, as (W x^T)^T, through oneDNN, through oneDNN with W stored in its blocked layout
VARIANTS = ("linear", "weight_left", "onednn", "onednn_packed")
# The row-invariant form's kernels: oneDNN's blocked products in chunks, the project's own (csrc/linear.cpp)
INVARIANT_VARIANTS = ("invariant", "native")
MAX_ROWS = 32  # blocks of more rows always use nn.Linear
# Row counts timed: every one up to 16 (drafts, verification), then a few (SAT trees, prompt lookup);
# a count in between takes the choice of the next timed one.
TIMED_ROWS = tuple(range(1, 17)) + (20, 24, 28, 32)
# "onednn_packed" keeps a second copy of each weight it routes; above this many bytes of weights it is
# not offered (SmolLM2-135M: 0.5 GB; a 7B model in float32 would need 28 GB more).
COPY_LIMIT_BYTES = 2 << 30
ROUTED_DTYPES = (torch.float32, torch.bfloat16)
# The row-invariant form (`invariant_plan`): oneDNN on blocked weights, the input dimension cut into chunks of
# at most this many, partial products summed in float32. Chunks this short came out bit-equal for a row alone
# and in blocks of 2..32 rows on the CPUs measured; longer ones did not (the kernel splits them by row count).
INVARIANT_CHUNK = 768
INVARIANT_ROWS = 32  # the plan's length; the invariant form serves every row count (a prompt's prefill too)
PLAN_FILE = "cpu_kernels.json"  # the tuned plans, in the engine's cache folder (default_model.cache_dir)
_PLAN_FORMAT = 4  # part of the stored plan's key: plans of other variant sets are tuned again
# A routed layer calls `module.__dict__[AFTER](module, (x,), output)`, where set, after its product, as PyTorch calls
# a forward hook (None keeps the output): the SAT adapter's update during a draft pass (sat.py), with no hook or
# wrapper around the call (either costs a draft pass more than the update's own arithmetic). It is state on the
# module, set only while such a pass runs (sat.SatAdapter.hooked), because the product's own call is the cheapest
# place left to run it.
AFTER = "_sdsat_after"

log = logging.getLogger(__name__)


@dataclass
class KernelPlan:
    """The fastest variant per weight shape (out, in) and row count: choices[shape][rows - 1]."""

    choices: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    seconds: float = 0.0  # time the tuning took

    @property
    def invariant(self) -> bool:
        """Every product through one kernel of the row-invariant form (`invariant_plan`)."""
        kinds = {variant for v in self.choices.values() for variant in v}
        return len(kinds) == 1 and kinds <= set(INVARIANT_VARIANTS)

    def summary(self) -> dict[str, list[str]]:
        return {f"{o}x{i}": v for (o, i), v in self.choices.items()}


_PLANS: dict[str, KernelPlan] = {}  # one tuning per process, machine, model layout and thread count
_INVARIANT: dict[str, str] = {}  # the row-invariant kernel chosen, by the same kind of key
# The attribute a model keeps its packs in while `reusing_packs` runs: per (layer, packing), the layer, the weight
# tensor packed, its version counter and the packed copy.
_PACK_MEMO = "_sdsat_pack_memo"


def _product(variant: str, x: torch.Tensor, weight: torch.Tensor, packed) -> torch.Tensor:
    """x (M, in) times W^T, for W (out, in): (M, out); `packed` is W by `_pack` (the onednn_packed form), or
    for the invariant form its chunks by `_pack_chunks`."""
    if variant == "invariant":
        return _chunked_product(x, packed)
    if variant == "native":
        return native.module().linear(x.contiguous(), weight if weight.is_contiguous() else weight.contiguous())
    if variant == "weight_left":
        return (weight @ x.t()).t()
    if variant in ("onednn", "onednn_packed"):
        w = packed if variant == "onednn_packed" else weight  # the dense form must not borrow the packed copy
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
    return nn.functional.linear(x, weight)


def _pack(weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    """W in oneDNN's blocked layout for products of up to `max_rows` rows (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, max_rows)


def _pack_chunks(weight: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
    """W cut along its input dimension into chunks of at most INVARIANT_CHUNK, each in oneDNN's blocked layout."""
    width = weight.shape[1]
    if width <= INVARIANT_CHUNK:
        return [_pack(weight, max_rows)]
    return [_pack(weight[:, i:i + INVARIANT_CHUNK].contiguous(), max_rows) for i in range(0, width, INVARIANT_CHUNK)]


def _chunked_product(x: torch.Tensor, chunks: list[torch.Tensor]) -> torch.Tensor:
    x = x.contiguous()
    if len(chunks) == 1:
        return torch.ops.mkldnn._linear_pointwise(x, chunks[0], None, "none", [], "")
    out = None
    for i, chunk in enumerate(chunks):
        part = torch.ops.mkldnn._linear_pointwise(x[:, i * INVARIANT_CHUNK:(i + 1) * INVARIANT_CHUNK].contiguous(),
                                                  chunk, None, "none", [], "").float()
        out = part if out is None else out + part
    return out.to(x.dtype)


def invariant_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this machine runs the row-invariant form in `dtype`: oneDNN's blocked products (internal to torch;
    its bfloat16 path needs AVX-512 or AMX), or the project's kernel where it is compiled for this machine."""
    return onednn_invariant(dtype) or native_linear_available()


@functools.cache
def onednn_invariant(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's blocked products run in `dtype` here (fixed for a process: asked once)."""
    return "onednn_packed" in _available_variants(0, dtype)


def native_linear_enabled() -> bool:
    """SDSAT_LINEAR_KERNEL=0 keeps the project's row-invariant kernel out (oneDNN's alone, where it runs)."""
    return os.environ.get("SDSAT_LINEAR_KERNEL", "1") != "0"


def native_linear_available() -> bool:
    """The project's kernel is switched on and compiled for this machine (loading it takes a moment)."""
    return native_linear_enabled() and native.built()


def invariant_plan(model: nn.Module, variant: str | None = None, cache_file: Path | None = None) -> KernelPlan:
    """Every product of 1..INVARIANT_ROWS rows through one kernel of the row-invariant form (whatever it costs):
    `variant`, else the faster of those this machine runs (`invariant_variant`)."""
    variant = variant or invariant_variant(model, cache_file)
    return KernelPlan({shape: [variant] * INVARIANT_ROWS for shape in _groups(model)})


def invariant_variant(model: nn.Module, cache_file: Path | None = None) -> str:
    """The row-invariant kernel for `model`'s weights: the only one this machine runs, else the faster of the two
    on the weights themselves (a pass's 1 and 4 rows), timed once per machine, model layout, thread count and
    build of the project's kernel, and kept with the kernel plans (`cache_file`)."""
    groups = _groups(model)
    dtype = next(iter(groups.values()))[0].weight.dtype if groups else torch.float32
    runs = [v for v, ok in zip(INVARIANT_VARIANTS, (onednn_invariant(dtype), native_linear_available())) if ok]
    if len(runs) < 2:
        return runs[0] if runs else "invariant"
    key = json.dumps([_PLAN_FORMAT, "invariant", cpu_name(), torch.__version__, torch.get_num_threads(),
                      str(dtype), native.digest(), sorted([list(shape), len(mods)] for shape, mods in groups.items())])
    if key in _INVARIANT:
        return _INVARIANT[key]
    stored = _read(cache_file).get(key)
    if stored in INVARIANT_VARIANTS:
        _INVARIANT[key] = stored
        return stored
    if native.build() is None:  # compiled here, yet it does not load: oneDNN's alone
        return "invariant"
    weights = [m.weight.detach() for mods in groups.values() for m in mods]
    packs = [_pack_chunks(w, MAX_ROWS) for w in weights]
    gen = torch.Generator().manual_seed(0)
    times = dict.fromkeys(INVARIANT_VARIANTS, 0.0)
    with torch.inference_mode():
        for rows in (1, 4):
            by_width = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights}
            best = _fastest(INVARIANT_VARIANTS, [by_width[w.shape[1]] for w in weights], weights, packs, rounds=3)
            times = {v: times[v] + best[v] for v in INVARIANT_VARIANTS}
    _INVARIANT[key] = choice = min(INVARIANT_VARIANTS, key=times.__getitem__)
    log.info("row-invariant products: %s (%s)", choice,
             ", ".join(f"{v} {t * 1e3:.1f} ms for 1 + 4 rows" for v, t in times.items()))
    _store(cache_file, key, choice)
    return choice


def _fastest(variants: tuple[str, ...], inputs: list[torch.Tensor], weights: list[torch.Tensor], packs: list,
             rounds: int) -> dict[str, float]:
    """Each variant's fastest of `rounds` timings of the products inputs[i] × weights[i]ᵀ, the variants interleaved
    in every round (the first round also warms up)."""
    times = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for variant in variants:
            t0 = timing.now()
            for x, w, p in zip(inputs, weights, packs):
                _product(variant, x, w, p)
            times[variant] = min(times[variant], timing.now() - t0)
    return times


def _store(cache_file: Path | None, key: str, value) -> None:
    """Keep `value` under `key` in the plan file beside the other entries of this format (stale formats dropped);
    without a file (a read-only home) it is measured again next time."""
    if cache_file is not None:
        kept = {k: v for k, v in _read(cache_file).items() if k.startswith(f"[{_PLAN_FORMAT},")}
        jsonfile.write_object(cache_file, kept | {key: value}, indent=1)


def _available_variants(total_bytes: int, dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The variants this torch build can run (oneDNN's ops are internal to torch: checked, not assumed)."""
    variants = ["linear", "weight_left"]
    try:
        w, x = torch.ones(2, 3, dtype=dtype), torch.ones(1, 3, dtype=dtype)
        if torch.equal(_product("onednn", x, w, None), torch.full((1, 2), 3.0, dtype=dtype)):
            variants.append("onednn")
            if total_bytes <= COPY_LIMIT_BYTES and torch.equal(_product("onednn_packed", x, w, _pack(w, 2)),
                                                               torch.full((1, 2), 3.0, dtype=dtype)):
                variants.append("onednn_packed")
    except (AttributeError, RuntimeError):
        pass
    return tuple(variants)


def _groups(model: nn.Module) -> dict[tuple[int, int], list[nn.Linear]]:
    groups: dict[tuple[int, int], list[nn.Linear]] = {}
    for module in model.modules():
        if (isinstance(module, nn.Linear) and module.weight.device.type == "cpu"
                and module.weight.dtype in ROUTED_DTYPES):
            groups.setdefault(tuple(module.weight.shape), []).append(module)
    return groups


def tune(model: nn.Module, max_rows: int = MAX_ROWS, repeats: int = 2, cache_file: Path | None = None,
         measure: bool = True) -> KernelPlan | None:
    """Time every variant for each weight shape and row count on `model`'s float32 or bfloat16 CPU weights.

    Timing every shape at every row count takes seconds, too long to repeat at each start, so the plan
    is kept for the process and, with `cache_file`, on disk under a key of the machine, torch, thread
    count and layer shapes. With `measure` False, only a kept plan is returned (None when there is none).
    """
    groups = _groups(model)
    dtypes = sorted({str(m.weight.dtype) for mods in groups.values() for m in mods})
    key = json.dumps([_PLAN_FORMAT, cpu_name(), torch.__version__, torch.get_num_threads(), max_rows, dtypes,
                      sorted([list(shape), len(mods)] for shape, mods in groups.items())])
    if key in _PLANS:
        return _PLANS[key]
    stored = _read(cache_file)
    if key in stored:
        choices = _parse_plan(stored[key], set(groups), max_rows)
        if choices is not None:
            _PLANS[key] = KernelPlan(choices)
            return _PLANS[key]
        _set_aside(cache_file, "its plan for this machine and model has bad entries")
    if not measure:
        return None
    log.info("measuring the CPU kernels of %d weight shapes (once per machine)", len(groups))
    start = timing.now()
    plan = KernelPlan()
    total = sum(m.weight.numel() * m.weight.element_size() for mods in groups.values() for m in mods)
    variants = _available_variants(total, next(iter(groups.values()))[0].weight.dtype if groups else torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape, modules in groups.items():
            weights = [m.weight for m in modules]
            packed = [_pack(w, max_rows) if "onednn_packed" in variants else None for w in weights]
            best = {}
            for rows in [r for r in TIMED_ROWS if r < max_rows] + [max_rows]:
                x = torch.randn(rows, shape[1], generator=gen).to(weights[0].dtype)
                times = _fastest(variants, [x] * len(weights), weights, packed, rounds=repeats + 1)
                best[rows] = min(variants, key=times.__getitem__)
            plan.choices[shape] = [best[min(t for t in best if t >= rows)] for rows in range(1, max_rows + 1)]
    plan.seconds = timing.now() - start
    _PLANS[key] = plan
    _store(cache_file, key, plan.summary())
    return plan


def _read(cache_file: Path | None) -> dict:
    """The stored plans by key; a file that is not a JSON object is set aside (and replaced once tuned)."""
    stored = jsonfile.read_object(cache_file)
    if stored is None:
        _set_aside(cache_file, "it is not a JSON object of plans")
        return {}
    return stored


def _parse_plan(entry, shapes: set, max_rows: int) -> dict[tuple[int, int], list[str]] | None:
    """A stored plan's choices, or None when the entry does not hold one known variant per row count for
    exactly `shapes` (a file edited by hand, or written by a broken version, must not reach `install`)."""
    if not isinstance(entry, dict):
        return None
    choices = {}
    for name, variants in entry.items():
        out, _, inp = name.partition("x")
        if not (out.isdigit() and inp.isdigit()) or not isinstance(variants, list) or len(variants) != max_rows:
            return None
        if not all(isinstance(v, str) and v in VARIANTS for v in variants):
            return None
        choices[(int(out), int(inp))] = variants
    return choices if set(choices) == shapes else None


def _set_aside(cache_file: Path, why: str) -> None:
    """Move a damaged plan file to <name>.bad (kept for a bug report) so that a fresh plan replaces it."""
    aside = cache_file.with_name(cache_file.name + ".bad")
    try:
        cache_file.replace(aside)
    except OSError:  # a read-only cache: the plan is tuned again each time, nothing worse
        aside = None
    log.warning("CPU kernel plan file %s is damaged (%s)%s; tuning again", cache_file, why,
                f", set aside as {aside.name}" if aside else "")


def install(model: nn.Module, plan: KernelPlan) -> int:
    """Route the products of `model`'s linear layers per `plan`; returns how many layers were routed."""
    if any("native" in choices for choices in plan.choices.values()) and native.build() is None:
        raise RuntimeError("the plan routes products to the compiled kernel, which cannot be built here")
    model._sdsat_kernel_plan = plan
    memo = model.__dict__.get(_PACK_MEMO)
    routed = 0
    for shape, modules in _groups(model).items():
        choices = plan.choices.get(shape)
        if choices is None or set(choices) == {"linear"}:
            continue
        for module in modules:
            packed = (  # before any attribute is set: a pack this CPU cannot make leaves the layer as it was
                None if "native" in choices  # reads the weight as it is
                else _packed(memo, module, "invariant", lambda w: _pack_chunks(w, MAX_ROWS)) if "invariant" in choices
                else _packed(memo, module, f"onednn_packed {len(choices)}", lambda w: _pack(w, len(choices)))
                if "onednn_packed" in choices else None)
            module._sdsat_choices, module._sdsat_packed = choices, packed
            module.forward = types.MethodType(_routed_forward, module)
            routed += 1
    return routed


@contextlib.contextmanager
def reusing_packs(model: nn.Module) -> Iterator[None]:
    """Within the block, `install` does not pack `model`'s weight tensors again that it packed before in the same
    way: a tuning switches forms dozens of times, and routing the same weights again then costs no copy.
    Afterwards the packed copies not in use are dropped."""
    if _PACK_MEMO in model.__dict__:  # an outer block keeps them
        yield
        return
    setattr(model, _PACK_MEMO, {})
    try:
        yield
    finally:
        delattr(model, _PACK_MEMO)


def drop_stale_packs(model: nn.Module) -> None:
    """Forget the packs of weight tensors that `model`'s layers no longer hold (another precision's, put back)."""
    memo = model.__dict__.get(_PACK_MEMO)
    if memo is not None:
        for key in [key for key, (module, weight, *_) in memo.items() if module.weight.data_ptr() != weight.data_ptr()]:
            del memo[key]


def _packed(memo: dict | None, module: nn.Linear, packing: str, pack):
    """`pack(module.weight)`, or the copy `memo` (by `reusing_packs`) holds of this very tensor, unchanged since."""
    weight = module.weight.detach()
    if memo is None:
        return pack(weight)
    held = memo.get((id(module), packing))
    if held is not None and held[0] is module and (
            held[1].data_ptr(), held[1].dtype, held[1].shape, held[1].stride(), held[2]) == (
            weight.data_ptr(), weight.dtype, weight.shape, weight.stride(), weight._version):
        return held[3]
    packed = pack(weight)
    memo[(id(module), packing)] = (module, weight, weight._version, packed)  # the tensor held: its memory stays its own
    return packed


def uninstall(model: nn.Module) -> None:
    model.__dict__.pop("_sdsat_kernel_plan", None)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            for name in ("forward", "_sdsat_choices", "_sdsat_packed"):
                module.__dict__.pop(name, None)


def routed(module: nn.Module) -> bool:
    """Whether `module` is a linear layer that `install` routed (its forward then calls AFTER, where set)."""
    return "_sdsat_choices" in module.__dict__


def installed_plan(model: nn.Module) -> KernelPlan | None:
    """The plan `install` routed `model` by, or None (not routed, or uninstalled)."""
    return getattr(model, "_sdsat_kernel_plan", None)


def _routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    invariant = self._sdsat_choices[0] in INVARIANT_VARIANTS  # every row count, a prompt's prefill included
    if not (1 <= rows <= len(self._sdsat_choices) or (invariant and rows)) or torch.is_grad_enabled():
        out = nn.functional.linear(x, self.weight, self.bias)
    else:
        variant = self._sdsat_choices[0] if invariant else self._sdsat_choices[rows - 1]
        out = _product(variant, x.reshape(rows, x.shape[-1]), self.weight, self._sdsat_packed)
        if self.bias is not None:
            out = out + self.bias
        out = out.reshape(*x.shape[:-1], out.shape[-1])
    after = self.__dict__.get(AFTER)
    if after is not None:
        changed = after(self, (x,), out)
        return out if changed is None else changed
    return out
