"""Load-time tuning: the precision, kernels and SDSAT settings this machine runs fastest, measured on the model.

For each precision the machine offers (on a CPU: float32 and bfloat16; elsewhere the loaded one, and
float32 for a small model loaded in half precision) it
measures the pass-cost curve and checks whether a row of a block comes out as it does alone
(costs.py). On a CPU each precision is tried in its row-invariant forms first: products through
oneDNN in chunks or the compiled kernel (cpu_kernels.invariant_plan) and attention in runs of rows with one key count
(bfloat16), in fixed-shape tiles, else one row at a time (attention.py). Where such a form passes the row
check, SDSAT decodes in it, and so does the vanilla decode it is compared with. The other forms' one-token
passes (the routed form: the fastest kernel per row count, cpu_kernels.tune; the per-row attention, faster
for one row) are timed too, for the fastest vanilla decoding. The planner (planner.py) then picks the
precision and settings with the best predicted speed-up over the fastest vanilla decoding of any precision
and form.

Rule for forms whose rows are not bit-equal alone and batched: greedy SDSAT decodes in a bit-equal
form whenever one was measured. Only when none is (no oneDNN, a GPU) may it use a form whose rows
differ by rounding alone (at most `costs.CLOSE_DRIFT` of the row's largest logit, the same top token:
float32): greedy output then equals vanilla's except at a near-tie within that rounding, and every
run reports whether it did. A form whose rows move by tenths of a logit (bfloat16 with batched
attention) is never used for SDSAT; its vanilla still counts as the baseline when it is faster.

Curves and row checks take seconds to a minute; they are kept in `~/.cache/sdsat/tuning.json` under a key
of the machine, torch, thread count and model, so a restart reads them, also those measured under load
(marked noisy, and measured again when the app finds the machine quiet, or on `python -m sdsat tune --force`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers

from . import attention, cpu_kernels, jsonfile, native, sat_kernel, weight_memory
from .costs import NOISY_SPREAD, CostCurve, RowCheck, check_rows, measure_curve
from .default_model import cache_dir
from .hardware import cpu_name
from .planner import CHAT_TRACE_FILE, TRACE_FILE, Plan, Trace, choose

log = logging.getLogger(__name__)

CPU_PRECISIONS = ("float32", "bfloat16")
# The forms of a precision on a CPU: row-invariant products with compiled, keyed (bfloat16), tiled or per-row
# attention, or routed (attention.py).
COMPILED, KEYED, INVARIANT, PER_ROW, ROUTED = ("row-invariant compiled", "row-invariant keyed", "row-invariant",
                                               "row-invariant per-row", "routed")
ROUTED_COMPILED = "routed, compiled attention"  # vanilla alone: the routed products with the compiled attention
EXACT_FORMS = (COMPILED, KEYED, INVARIANT, PER_ROW)  # tried in this order (see exact_forms); the first whose rows
# check bit-equal is SDSAT's
# The attention each form sets on a CPU (attention.py; ROUTED's is SDPA)
ATTENTION_OF = {COMPILED: attention.COMPILED, KEYED: attention.KEYED, INVARIANT: attention.TILED,
                PER_ROW: attention.PER_ROW, ROUTED_COMPILED: attention.COMPILED}
_FORMAT = 10  # 10: the curves time the fused pass
MEASURE_ROUNDS = 2  # a noisy curve: the precisions measured now are measured once more (see `tune`)
# After the curves, every form's one-token pass is timed again in this many rounds (see `_time_again`), each of
# REVISIT_PASSES passes.
REVISIT_ROUNDS = 2
REVISIT_PASSES = 8
TUNING_FILE = "tuning.json"  # the measurements, in the engine's cache folder (default_model.cache_dir)


@dataclass
class Tuning:
    """What was measured at load and what it chose."""

    curves: dict[str, CostCurve] = field(default_factory=dict)  # by precision: the form SDSAT would decode in
    rows: dict[str, RowCheck] = field(default_factory=dict)
    forms: dict[str, str] = field(default_factory=dict)  # by precision: one of EXACT_FORMS, or ROUTED
    vanilla_s: dict[str, float] = field(default_factory=dict)  # "<precision> <form>": another form's one-token pass
    plan: Plan | None = None  # None: no acceptance trace for these SATs (then `note` says so)
    note: str = ""
    trace: Trace | None = field(default=None, repr=False)
    chat_trace: Trace | None = field(default=None, repr=False)  # chat prompts' trace, where the SATs ship one
    max_k: int = 0
    noisy: dict[str, bool] = field(default_factory=dict)  # by precision: measured while the cores were busy
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # plan_for's other plans

    def plan_for(self, schemes: tuple[str, ...] = ("two_step",), greedy: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, chat: bool = False) -> Plan | None:
        """The plan among `schemes` only (the page has no fused control), in the precision the model is in;
        for sampling (`greedy` False) at `temperature`, `top_p` and `top_k`, priced at the trace's nearest
        measured sampled acceptance; for a chat request (`chat`), replayed over the chat prompts' trace where
        the SATs ship one (chat drafts are right less often than code's, and its text repeats itself less)."""
        if self.plan is None or self.trace is None:
            return None
        trace = self.trace_for(chat)
        if greedy and self.plan.settings.scheme in schemes and trace is self.trace:
            return self.plan
        sampled = None if greedy else trace.sampled_at(temperature, top_p, top_k)
        key = (schemes, greedy, sampled and (sampled.temperature, sampled.top_p, sampled.top_k), trace is self.trace)
        if key not in self._plans:  # a replay of every setting: worth keeping per request kind
            self._plans[key] = choose(list(self.curves.values()), trace, self.max_k, greedy,
                                      usable={self.plan.dtype}, schemes=schemes, baseline=self.baseline,
                                      names=self.names, temperature=temperature, top_p=top_p, top_k=top_k)
        return self._plans[key]

    def trace_for(self, chat: bool = False) -> Trace | None:
        """The trace a request is planned over: chat's where `chat` and the SATs ship one, else the code trace."""
        return self.chat_trace if chat and self.chat_trace is not None else self.trace

    @property
    def names(self) -> dict[str, str]:
        """Each precision as results name it: "float32 row-invariant", "bfloat16 routed"."""
        return {p: f"{p} {self.forms[p]}" if p in self.forms else p for p in self.curves}

    def forms_timed(self, precision: str) -> dict[str, float]:
        """Each form of `precision` whose one-token pass was timed at load: its seconds."""
        timed = {self.forms.get(precision, ""): self.curves[precision].one_token_s} if precision in self.curves else {}
        prefix = f"{precision} "
        return timed | {name.removeprefix(prefix): s for name, s in self.vanilla_s.items() if name.startswith(prefix)}

    @property
    def baseline(self) -> tuple[str, float]:
        """The fastest vanilla decoding measured, in any precision and form: (name, seconds per token)."""
        timed = {self.names[p]: c.one_token_s for p, c in self.curves.items()}
        return min((timed | self.vanilla_s).items(), key=lambda item: item[1])

    @property
    def baseline_s(self) -> float:
        return self.baseline[1]

    @property
    def usable(self) -> list[str]:
        """Precisions greedy SDSAT may decode in (see the module's rule)."""
        exact = [p for p, check in self.rows.items() if check.invariant]
        return exact or [p for p, check in self.rows.items() if check.close]

    def to_dict(self) -> dict:
        return {"curves": {p: c.to_dict() for p, c in self.curves.items()}, "forms": self.forms,
                "rows": {p: r.to_dict() for p, r in self.rows.items()}, "usable": self.usable,
                "vanilla_seconds_per_token": self.vanilla_s,
                "baseline": {"decoding": self.baseline[0], "seconds_per_token": self.baseline[1]},
                "plan": self.plan.to_dict() if self.plan else None, "note": self.note,
                "measured_under_load": sorted(p for p, noisy in self.noisy.items() if noisy)}


def dtype_name(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def set_precision(sat_model, precision: str, kernels: bool = True, form: str = ROUTED) -> None:
    """Convert the model (and its SAT adapter) to `precision` in place, in `form`: on a CPU with kernels,
    ROUTED is the fastest kernel per row count and batched SDPA attention (ROUTED_COMPILED: with the compiled
    attention), INVARIANT the row-invariant products and tiled attention, PER_ROW those products and per-row
    attention, KEYED and COMPILED those products and the keyed or compiled attention (attention.py). Elsewhere
    the products are nn.Linear's and the attention SDPA."""
    model = sat_model.model
    on_cpu = kernels and next(model.parameters()).device.type == "cpu"
    if on_cpu and form in (COMPILED, ROUTED_COMPILED) and native.build() is None:  # before anything is changed
        raise RuntimeError(f"the {form} form needs the compiled kernels, which cannot be built here")
    dtype = getattr(torch, precision)
    if on_cpu and form in EXACT_FORMS and not cpu_kernels.invariant_available(dtype):
        raise RuntimeError(f"the {form} form needs row-invariant {precision} products (oneDNN's blocked ones, or the "
                           "compiled kernel), which this machine lacks")
    cpu_kernels.uninstall(model)
    buffers = _float_buffers(model)  # the rotary frequencies: .to() would round them to `dtype` for good
    model.to(dtype)
    _put_buffers(model, buffers)
    if on_cpu:
        weight_memory.gather(model)  # one block of memory, on huge pages where granted
    if sat_model.adapter is not None:  # on a CPU in float32: its small products are far slower in bfloat16
        sat_model.adapter.to(torch.float32 if on_cpu else dtype)
    invariant = form in EXACT_FORMS and on_cpu
    attention.register()
    model.set_attn_implementation(ATTENTION_OF[form] if on_cpu and form in ATTENTION_OF else "sdpa")
    if invariant:
        cpu_kernels.install(model, cpu_kernels.invariant_plan(model, cache_file=cache_dir() / cpu_kernels.PLAN_FILE))
    elif on_cpu:
        cpu_kernels.install(model, cpu_kernels.tune(model, cache_file=cache_dir() / cpu_kernels.PLAN_FILE))


def fallback_form(sat_model, kernels: bool = True) -> str:
    """Put the model, in its loaded precision, in the form it decodes in until a tuning exists, measuring
    nothing: the row-invariant products with attention one row at a time where this torch has those
    kernels (the form that needs no row check: the tiled attention is checked per machine), else as
    loaded. Returns the form."""
    precision = dtype_name(sat_model.model)
    if _invariant_forms(sat_model, precision, kernels) and not in_form(sat_model, precision, kernels, PER_ROW):
        set_precision(sat_model, precision, kernels, PER_ROW)
    return form_of(sat_model.model)


def _float_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}


def _put_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, value)


def in_form(sat_model, precision: str, kernels: bool, form: str) -> bool:
    """Whether the model already is in `precision` and `form` as `set_precision` would leave it (a CPU model
    loaded without a kernel plan reads as routed by `form_of`, but its products are not routed yet)."""
    model = sat_model.model
    if (precision, form) != (dtype_name(model), form_of(model)):
        return False
    routable = kernels and next(model.parameters()).device.type == "cpu"
    return form not in (ROUTED, ROUTED_COMPILED) or not routable or cpu_kernels.installed_plan(model) is not None


def form_of(model: torch.nn.Module) -> str:
    plan = cpu_kernels.installed_plan(model)
    attn = model.config._attn_implementation
    names = {attention_name: form for form, attention_name in ATTENTION_OF.items() if form in EXACT_FORMS}
    if plan is None or not plan.invariant or attn not in names:
        return ROUTED_COMPILED if attn == attention.COMPILED else ROUTED
    return names[attn]


@contextlib.contextmanager
def trying(sat_model, precision: str, kernels: bool = True, form: str = ROUTED):
    """The model in `precision` and `form` for the block; afterwards as it was, bit for bit."""
    model = sat_model.model
    if in_form(sat_model, precision, kernels, form):
        yield
        return
    modules = [m for m in (model, sat_model.adapter) if m is not None]
    # Each parameter's tensor itself, not a copy: a conversion gives the parameter a new tensor and leaves this one
    # as it was, so putting it back restores the model bit for bit, and `install` finds the packs it made of it.
    # The owner and name too, where a conversion gives the module a new parameter object.
    params = [(owner, name, param, param.data) for m in modules for owner in m.modules()
              for name, param in owner.named_parameters(recurse=False)]
    buffers = [_float_buffers(m) for m in modules]  # the adapter's too: its base embedding
    plan = cpu_kernels.installed_plan(model)
    attn = model.config._attn_implementation
    with cpu_kernels.reusing_packs(model):
        try:
            set_precision(sat_model, precision, kernels, form)
            yield
        finally:
            cpu_kernels.uninstall(model)
            for owner, name, param, data in params:
                owner._parameters[name] = param
                param.data = data
            for m, kept in zip(modules, buffers):
                _put_buffers(m, kept)
            model.set_attn_implementation(attn)
            if plan is not None:
                cpu_kernels.install(model, plan)
            cpu_kernels.drop_stale_packs(model)


def precisions_to_try(model: torch.nn.Module, fixed: bool) -> list[str]:
    """The loaded precision and, unless the caller fixed the dtype, for models small enough to hold a second
    copy of their weights while measuring: on a CPU the others of CPU_PRECISIONS; elsewhere (a GPU) float32
    when the loaded one is half precision. A GPU's batched half-precision rows move by tenths of a logit,
    so SDSAT may not decode in them, while its float32 rows differ by rounding alone (close)."""
    loaded = dtype_name(model)
    param = next(model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if fixed or size > cpu_kernels.COPY_LIMIT_BYTES:
        return [loaded]
    if param.device.type == "cpu":
        return [loaded] + [p for p in CPU_PRECISIONS if p != loaded]
    half = loaded in ("float16", "bfloat16") and 2 * size <= cpu_kernels.COPY_LIMIT_BYTES  # float32's copy: twice
    return [loaded, "float32"] if half else [loaded]


def load_trace(sat_model, name: str = TRACE_FILE) -> Trace | None:
    """The acceptance trace shipped next to the SAT adapter, if any (`name`: CHAT_TRACE_FILE for chat's)."""
    folder = sat_model.spec.adapter
    path = Path(folder) / name if folder else None
    if path is None or not path.is_file():
        return None
    try:
        return Trace.load(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("acceptance trace %s cannot be read (%s); %s", path, err,
                    "auto keeps the default settings" if name == TRACE_FILE else "chat requests take the code plan")
        return None


@dataclass
class TuneProgress:
    """Where a tuning stands: the page and the console show it while it runs."""

    done: int = 0  # measurement steps finished
    total: int = 0  # steps expected (it grows where a form fails its row check or a noisy curve goes again, and
    # shrinks where a kept measurement stays better than a new one: not timed again)
    label: str = ""  # what is measured now, e.g. "bfloat16 row-invariant: cost curve and row check"
    started: float = field(default_factory=time.monotonic)

    def left_s(self) -> float | None:
        """Seconds still to go at the pace so far; None before the first step ends."""
        if not self.done:
            return None
        return (time.monotonic() - self.started) / self.done * max(self.total - self.done, 0)

    def line(self) -> str:
        if not self.total:
            return f"measuring this machine ({self.label})"
        left = self.left_s()
        return (f"measuring this machine: step {min(self.done + 1, self.total)} of {self.total} ({self.label})"
                + (f", about {left:.0f} s left" if left is not None else ""))


class _Steps:
    """Counts measurement steps for a `TuneProgress` and tells `on_step` (which may wait there) before each;
    notes when `requests_begun` (a count of the app's decodes) grew during a step: a request overlapped it."""

    def __init__(self, total: int, on_step: Callable[[TuneProgress], None] | None,
                 requests_begun: Callable[[], int] | None = None):
        self.state = TuneProgress(total=total)
        self.on_step = on_step
        self.requests_begun = requests_begun or (lambda: 0)
        self.overlapped = False  # since the caller last cleared it

    @contextlib.contextmanager
    def step(self, label: str):
        self.state.label = label
        self.state.total = max(self.state.total, self.state.done + 1)
        log.info("%s", self.state.line())
        if self.on_step is not None:
            self.on_step(self.state)
        begun = self.requests_begun()
        yield
        self.overlapped |= self.requests_begun() != begun
        self.state.done += 1


def _steps_per_precision(sat_model, precision: str, kernels: bool) -> int:
    """Measurement steps of one precision when its first row-invariant form checks out: that form's curve and
    row check, then the other forms' one-token passes; one step where no invariant form exists."""
    if not _invariant_forms(sat_model, precision, kernels):
        return 1
    return len(exact_forms(precision)) + len(_routed_forms(precision))


def _routed_forms(precision: str) -> list[str]:
    """The forms timed for vanilla alone: the routed products, and with the compiled attention where SDSAT's
    forms have it (the fastest plain decoding may use what SDSAT's form does)."""
    return [ROUTED] + ([ROUTED_COMPILED] if COMPILED in exact_forms(precision) else [])


def exact_forms(precision: str) -> tuple[str, ...]:
    """The row-invariant forms tried for `precision`, in order: the compiled attention where the compiled kernels
    are built for this machine (native.built) and not turned off; the keyed attention in bfloat16 alone (in other
    precisions it would compute as the tiled form does); none where this CPU or torch lacks their products."""
    if not cpu_kernels.invariant_available(getattr(torch, precision)):  # none without row-invariant products
        return ()
    compiled = attention.compiled_enabled() and native.built()
    return tuple(f for f in EXACT_FORMS if (f != KEYED or precision == "bfloat16") and (f != COMPILED or compiled))


def _invariant_forms(sat_model, precision: str, kernels: bool) -> bool:
    model = sat_model.model
    on_cpu = kernels and next(model.parameters()).device.type == "cpu"
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # oneDNN's form keeps a blocked copy
    return on_cpu and size <= cpu_kernels.COPY_LIMIT_BYTES and cpu_kernels.invariant_available(
        getattr(torch, precision))


def _measure(sat_model, precision: str, kernels: bool, steps: _Steps) -> _Measured:
    """SDSAT's form of `precision` with its curve and row check, and the other forms' one-token seconds."""
    if _invariant_forms(sat_model, precision, kernels):
        for form in exact_forms(precision):
            with steps.step(f"{precision} {form}: cost curve and row check"), \
                    trying(sat_model, precision, kernels, form), torch.inference_mode():
                curve, rows = measure_curve(sat_model), check_rows(sat_model)
            if rows.invariant:
                others = {}
                for other in [f for f in exact_forms(precision) if f != form] + _routed_forms(precision):
                    what = "kernel plan and one-token pass" if other in (ROUTED, ROUTED_COMPILED) else "one-token pass"
                    with steps.step(f"{precision} {other}: {what}"), trying(sat_model, precision, kernels, other), \
                            torch.inference_mode():
                        others[other] = _one_token_pass(sat_model)
                noisy = curve.noisy or any(c.noisy for c in others.values())
                return _Measured(form, curve, rows, {f: c.fastest_one_token_s for f, c in others.items()}, noisy)
            steps.state.total += 1  # the next form's curve and row check, before the others' one-token passes
        steps.state.total -= len(exact_forms(precision)) + len(_routed_forms(precision)) - 1  # none checked out:
        # the routed form's one step instead
    with steps.step(f"{precision} {ROUTED}: kernel plan, cost curve and row check"), \
            trying(sat_model, precision, kernels, ROUTED), torch.inference_mode():
        curve = measure_curve(sat_model)
        return _Measured(ROUTED, curve, check_rows(sat_model), {}, curve.noisy)


def _one_token_pass(sat_model, repeats: int = 5) -> CostCurve:
    """A curve of the one-token pass alone, behind the usual cache."""
    return measure_curve(sat_model, widths=(1,), drafts=0, trees=False, repeats=repeats)


def _time_again(sat_model, measured: dict[str, "_Measured"], kernels: bool, steps: _Steps) -> None:
    """Time every form's one-token pass again in REVISIT_ROUNDS rounds after the curves, precisions and forms in
    turns (each round in the other order), and keep each form's fastest pass of all its timings: a curve's rounds
    take a few seconds, and a shared machine can be slow for that long (a neighbour's load), while two forms
    compared, or two tunings of one machine, must not differ by when each was timed. Each form is then timed at
    three moments of the tuning, not one; SDSAT's form keeps its curve's shape, at that fastest one-token pass."""
    fastest = {(p, m.form): m.curve.fastest_one_token_s for p, m in measured.items()}
    fastest |= {(p, form): s for p, m in measured.items() for form, s in m.others_s.items()}
    order = list(measured)
    for round_ in range(REVISIT_ROUNDS):
        for precision in order[::-1] if round_ % 2 == 0 else order:
            forms = [form for p, form in fastest if p == precision]
            with steps.step(f"{precision}: every form's one-token pass again ({round_ + 1} of {REVISIT_ROUNDS})"):
                for form in forms[round_ % len(forms):] + forms[:round_ % len(forms)]:
                    with trying(sat_model, precision, kernels, form), torch.inference_mode():
                        again = _one_token_pass(sat_model, REVISIT_PASSES)
                    fastest[(precision, form)] = min(fastest[(precision, form)], again.fastest_one_token_s)
    for precision, m in measured.items():
        m.curve = m.curve.at_one_token_s(fastest[(precision, m.form)])
        m.others_s = {form: fastest[(precision, form)] for form in m.others_s}


@dataclass
class _Measured:
    """One precision's measurement, as measured now or read back from the cache file."""

    form: str  # SDSAT's form: one of EXACT_FORMS, or ROUTED
    curve: CostCurve
    rows: RowCheck
    others_s: dict[str, float]  # the other forms' one-token seconds (their fastest pass), by form
    noisy: bool  # something else used the cores while measuring (kept all the same: see `tune`)

    def rank(self) -> tuple[bool, float]:
        """Of two runs of one precision the better: a clean one before a noisy one, then the faster."""
        return self.noisy, self.curve.fastest_one_token_s

    def to_dict(self) -> dict:
        return {"form": self.form, "curve": self.curve.to_dict(), "others_s": self.others_s, "noisy": self.noisy,
                "rows": {k: v for k, v in self.rows.to_dict().items() if k not in ("invariant", "close")}}

    @classmethod
    def from_dict(cls, entry) -> "_Measured | None":
        """A measurement kept on disk, or None (none, or unreadable: measured again)."""
        try:
            curve = CostCurve.from_dict(entry["curve"])
            return cls(entry["form"], curve, RowCheck(**entry["rows"]), dict(entry.get("others_s") or {}),
                       bool(entry.get("noisy", curve.noisy)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


REMEASURE = ("never", "missing", "noisy", "all")


def tune(sat_model, model_name: str, fixed_dtype: bool = False, kernels: bool = True,
         cache_file: Path | None = None, remeasure: str = "missing",
         on_step: Callable[[TuneProgress], None] | None = None,
         requests_begun: Callable[[], int] | None = None,
         warm_up: Callable[[], None] | None = None) -> Tuning | None:
    """Measure every precision worth trying (or read it from `cache_file`), plan, and leave the model in the
    chosen precision and form.

    remeasure: which precisions are measured now rather than read from the cache file: "missing" (those with
    nothing stored), "noisy" (those too with a measurement taken under load: the app's refresh when the machine
    is quiet: the kept run is replaced only by a better one, clean before noisy, then faster), "all"
    (`python -m sdsat tune --force`: replaced whatever it is), or "never" (then None when anything is missing;
    nothing is measured). A measurement taken under load is kept like a clean one, so later starts do not
    pay for it again.
    on_step: told before each measurement step (`TuneProgress`), and may wait there (for requests to finish).
    requests_begun: a count of requests begun (the app's); one begun during a step marks its precision's
    measurement noisy, as load from elsewhere would.
    warm_up: run once before the first measurement, when anything is measured: a process that has not decoded
    yet times its passes slower than one that has (docs/results.md, "The tuning behind the page"), and the
    page's start-up has decoded by then, the command line's not.

    Precisions are measured one after the other, so a spell of load from elsewhere (a neighbour on a shared
    host) can slow one precision's passes and not another's, and tip the choice. When a curve comes out
    noisy, every precision measured now is measured once more, in reverse order, and each keeps its better
    run (a clean one before a noisy one, then the faster). Slow spells that leave no spread within a step are
    met by `_time_again`: every form's one-token pass is timed again in later rounds, and each keeps its
    fastest."""
    if remeasure not in REMEASURE:
        raise ValueError(f"remeasure must be one of {', '.join(REMEASURE)}; got {remeasure!r}")
    model = sat_model.model
    tuning = Tuning()
    stored = jsonfile.read_object(cache_file) or {}
    precisions = precisions_to_try(model, fixed_dtype)
    compiled = (kernels and next(model.parameters()).device.type == "cpu"
                and (attention.compiled_enabled() or sat_kernel.enabled() or cpu_kernels.native_linear_enabled()))
    if remeasure != "never" and compiled:
        native.build()  # passes are timed as they will run (compiled once per machine, then loaded in a moment)
    keys = {p: json.dumps([_FORMAT, cpu_name(), torch.__version__, transformers.__version__, torch.get_num_threads(),
                           model_name, str(next(model.parameters()).device.type), p, sat_model.max_k, kernels,
                           exact_forms(p), native.digest() if compiled else None,  # timed with these kernels
                           cpu_kernels.native_linear_enabled()])
            for p in precisions}
    kept = {p: _Measured.from_dict(stored.get(keys[p])) for p in precisions}
    fresh = [p for p in precisions if kept[p] is None or remeasure == "all"
             or (remeasure == "noisy" and kept[p].noisy)]
    if fresh and remeasure == "never":
        return None
    # "noisy": the kept run competes with the new ones; otherwise a precision measured now starts afresh
    found = {p: kept[p] if p not in fresh or remeasure == "noisy" else None for p in precisions}
    steps = _Steps(sum(_steps_per_precision(sat_model, p, kernels) for p in fresh) + REVISIT_ROUNDS * len(fresh),
                   on_step, requests_begun)
    with cpu_kernels.reusing_packs(model):  # the forms come and go: their weights are not packed again
        if fresh and warm_up is not None:
            warm_up()
        for round_ in range(MEASURE_ROUNDS):
            for precision in fresh if round_ % 2 == 0 else fresh[::-1]:
                steps.overlapped = False
                measured = _measure(sat_model, precision, kernels, steps)
                measured.noisy |= steps.overlapped
                if found[precision] is None or measured.rank() < found[precision].rank():
                    found[precision] = measured
            if not any(found[p].noisy for p in fresh):
                break
            if round_ + 1 < MEASURE_ROUNDS:
                steps.state.total += sum(_steps_per_precision(sat_model, p, kernels) for p in fresh)
        measured_now = {p: found[p] for p in fresh if found[p] is not kept[p]}  # not a kept run that stayed better
        steps.state.total -= REVISIT_ROUNDS * (len(fresh) - len(measured_now))
        if measured_now:
            _time_again(sat_model, measured_now, kernels, steps)
    for precision in precisions:
        measured = found[precision]
        if precision in fresh:
            if measured.noisy:
                log.warning("the %s pass costs were measured while something else used the cores (one-token "
                            "rounds over %.1f-fold apart); they are kept, and measured again when the machine is "
                            "quiet (or by `python -m sdsat tune --force`)", precision, NOISY_SPREAD)
            if measured is not kept[precision]:
                stored[keys[precision]] = measured.to_dict()
        tuning.forms[precision], tuning.curves[precision], tuning.rows[precision] = (measured.form, measured.curve,
                                                                                    measured.rows)
        tuning.noisy[precision] = measured.noisy
        for other, seconds in measured.others_s.items():
            tuning.vanilla_s[f"{precision} {other}"] = seconds
    if cache_file is not None and fresh:
        jsonfile.write_object(cache_file, stored)
    _plan(tuning, sat_model, kernels)
    return tuning


def _plan(tuning: Tuning, sat_model, kernels: bool) -> None:
    """Choose, and leave the model in the chosen precision and form."""
    trace = tuning.trace = load_trace(sat_model)
    tuning.chat_trace = load_trace(sat_model, CHAT_TRACE_FILE)
    tuning.max_k = sat_model.max_k
    loaded = dtype_name(sat_model.model)
    if loaded in tuning.usable and tuning.forms.get(loaded) in EXACT_FORMS:  # exact decoding even without a plan
        set_precision(sat_model, loaded, kernels, tuning.forms[loaded])
    if trace is None:
        tuning.note = "no acceptance trace ships with these SATs: auto uses the default settings"
    elif not tuning.usable:
        tuning.note = "no precision keeps rows close enough for greedy SDSAT: auto uses the loaded one"
    else:
        tuning.plan = choose(list(tuning.curves.values()), trace, sat_model.max_k, usable=set(tuning.usable),
                             baseline=tuning.baseline, names=tuning.names)
        precision = tuning.plan.dtype
        form = tuning.forms[precision]
        if not in_form(sat_model, precision, kernels, form):
            set_precision(sat_model, precision, kernels, form)
        log.info("auto: %s", tuning.plan.reason)
