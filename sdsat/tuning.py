"""Load-time tuning: the precision and the SDSAT settings this machine runs fastest, measured on the model.

For each precision the machine offers (on a CPU: float32 and bfloat16, each with its own kernel plan
from cpu_kernels.py; elsewhere the loaded one) it measures the pass-cost curve and checks whether a
row of a block comes out as it does alone (costs.py). The planner (planner.py) then picks the
precision and settings with the best predicted speed-up over the fastest vanilla decoding.

Rule for precisions whose rows are not bit-equal alone and batched: greedy SDSAT may decode in a
precision only when every checked row is bit-equal, or differs by rounding alone (at most
`costs.CLOSE_DRIFT`, with the same top token): float32. Greedy output then equals vanilla's in the same
precision except at a near-tie within that rounding, and every run reports whether it did. A precision
whose rows move by whole tenths of a logit (bfloat16 on most CPUs) is never chosen for SDSAT, but its
vanilla still counts as the baseline to beat when it is faster.

Curves and row checks take seconds; they are kept in `~/.cache/sdsat/tuning.json` under a key of the
machine, torch, thread count and model, so a restart reads them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cpu_kernels
from .costs import CostCurve, RowCheck, check_rows, measure_curve
from .default_model import cache_dir
from .hardware import cpu_name
from .planner import TRACE_FILE, Plan, Trace, choose

log = logging.getLogger(__name__)

CPU_PRECISIONS = ("float32", "bfloat16")
_FORMAT = 1
_ATTENTION = {"bfloat16": "eager"}  # bfloat16's SDPA path mixes rows (issue 15); float32 keeps the loaded kernel


@dataclass
class Tuning:
    """What was measured at load and what it chose."""

    curves: dict[str, CostCurve] = field(default_factory=dict)  # by precision
    rows: dict[str, RowCheck] = field(default_factory=dict)
    plan: Plan | None = None  # None: no acceptance trace for these SATs (then `note` says so)
    note: str = ""
    trace: Trace | None = field(default=None, repr=False)
    max_k: int = 0

    def plan_for(self, schemes: tuple[str, ...] = ("two_step",), greedy: bool = True) -> Plan | None:
        """The plan among `schemes` only (the page has no fused control), in the precision the model is in."""
        if self.plan is None or self.trace is None:
            return None
        if self.plan.settings.scheme in schemes and (greedy or not self.plan.settings.tree_candidates):
            return self.plan
        return choose([c for c in self.curves.values()], self.trace, self.max_k, greedy,
                      usable={self.plan.dtype}, schemes=schemes)

    @property
    def baseline_s(self) -> float:
        """Seconds per token of the fastest vanilla decoding measured, in any precision."""
        return min(c.one_token_s for c in self.curves.values())

    @property
    def usable(self) -> list[str]:
        """Precisions greedy SDSAT may decode in (see the module's rule)."""
        return [p for p, check in self.rows.items() if check.invariant or check.close]

    def to_dict(self) -> dict:
        return {"curves": {p: c.to_dict() for p, c in self.curves.items()},
                "rows": {p: r.to_dict() for p, r in self.rows.items()}, "usable": self.usable,
                "plan": self.plan.to_dict() if self.plan else None, "note": self.note}


def dtype_name(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def set_precision(sat_model, precision: str, kernels: bool = True) -> None:
    """Convert the model (and its SAT adapter) to `precision` in place, with that precision's attention
    kernel and, on a CPU, its own kernel plan."""
    model = sat_model.model
    cpu_kernels.uninstall(model)
    dtype = getattr(torch, precision)
    model.to(dtype)
    if sat_model.adapter is not None:
        sat_model.adapter.to(dtype)
    model.set_attn_implementation(_ATTENTION.get(precision, "sdpa"))
    if kernels and next(model.parameters()).device.type == "cpu":
        cpu_kernels.install(model, cpu_kernels.tune(model, cache_file=cache_dir() / "cpu_kernels.json"))


@contextlib.contextmanager
def trying(sat_model, precision: str, kernels: bool = True):
    """The model in `precision` for the block; afterwards as it was, bit for bit."""
    model = sat_model.model
    before = dtype_name(model)
    if precision == before:
        yield
        return
    modules = [m for m in (model, sat_model.adapter) if m is not None]
    saved = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]
    plan = cpu_kernels.installed_plan(model)
    attention = model.config._attn_implementation
    try:
        set_precision(sat_model, precision, kernels)
        yield
    finally:
        cpu_kernels.uninstall(model)
        for m, state in zip(modules, saved):
            m.to(getattr(torch, before))
            m.load_state_dict(state)
        model.set_attn_implementation(attention)
        if plan is not None:
            cpu_kernels.install(model, plan)


def precisions_to_try(model: torch.nn.Module, fixed: bool) -> list[str]:
    """The loaded precision, and on a CPU (unless the caller fixed the dtype) the others of CPU_PRECISIONS
    for models small enough to hold a second copy of their weights while measuring."""
    loaded = dtype_name(model)
    param = next(model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if fixed or param.device.type != "cpu" or size > cpu_kernels.COPY_LIMIT_BYTES:
        return [loaded]
    return [loaded] + [p for p in CPU_PRECISIONS if p != loaded]


def load_trace(sat_model) -> Trace | None:
    """The acceptance trace shipped next to the SAT adapter, if any."""
    folder = sat_model.spec.adapter
    path = Path(folder) / TRACE_FILE if folder else None
    if path is None or not path.is_file():
        return None
    try:
        return Trace.load(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("acceptance trace %s cannot be read (%s); auto keeps the default settings", path, err)
        return None


def tune(sat_model, model_name: str, fixed_dtype: bool = False, kernels: bool = True,
         cache_file: Path | None = None) -> Tuning:
    """Measure every precision worth trying, plan, and leave the model in the chosen precision."""
    model = sat_model.model
    tuning = Tuning()
    stored = _read(cache_file)
    for precision in precisions_to_try(model, fixed_dtype):
        key = json.dumps([_FORMAT, cpu_name(), torch.__version__, torch.get_num_threads(), model_name,
                          str(next(model.parameters()).device.type), precision, sat_model.max_k, kernels])
        if key in stored:
            try:
                tuning.curves[precision] = CostCurve.from_dict(stored[key]["curve"])
                tuning.rows[precision] = RowCheck(**stored[key]["rows"])
                continue
            except (KeyError, TypeError, ValueError):
                pass  # measured again below
        with trying(sat_model, precision, kernels):
            with torch.inference_mode():
                tuning.curves[precision] = measure_curve(sat_model)
                tuning.rows[precision] = check_rows(sat_model)
        if tuning.curves[precision].noisy:
            log.warning("the %s pass costs were measured while something else used the cores (rounds differ "
                        "%.1f-fold); they are used now and measured again at the next start", precision,
                        tuning.curves[precision].spread)
            continue
        stored[key] = {"curve": tuning.curves[precision].to_dict(),
                       "rows": {k: v for k, v in tuning.rows[precision].to_dict().items()
                                if k not in ("invariant", "close")}}
    _write(cache_file, stored)
    trace = tuning.trace = load_trace(sat_model)
    tuning.max_k = sat_model.max_k
    if trace is None:
        tuning.note = "no acceptance trace ships with these SATs: auto uses the default settings"
    elif not tuning.usable:
        tuning.note = "no precision keeps rows close enough for greedy SDSAT: auto uses the loaded one"
    else:
        tuning.plan = choose(list(tuning.curves.values()), trace, sat_model.max_k, usable=set(tuning.usable))
        if tuning.plan.dtype != dtype_name(model):
            set_precision(sat_model, tuning.plan.dtype, kernels)
        log.info("auto: %s", tuning.plan.reason)
    return tuning


def _read(cache_file: Path | None) -> dict:
    if cache_file is None or not cache_file.is_file():
        return {}
    try:
        stored = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _write(cache_file: Path | None, stored: dict) -> None:
    if cache_file is None:
        return
    tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(stored))
        tmp.replace(cache_file)
    except OSError:  # a read-only cache: measured again next time
        pass
    finally:
        tmp.unlink(missing_ok=True)
