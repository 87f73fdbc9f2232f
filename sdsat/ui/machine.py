"""This machine, as the page explains it: what a forward pass costs here (measured when the model loads,
`Engine.tune`), which precisions SDSAT may decode in, auto's plan, and what those costs say about a race.

A race's speed-up is measured; beside it the page puts two numbers from the cost curve, both against
vanilla in the race's own precision and kernel form (the race's vanilla runs in it too):
- predicted: the planner's replay of the SATs' shipped acceptance trace under the race's settings
  (`planner.predict`), what these settings should give on this machine over typical code prompts;
- implied: this race's own tokens ÷ what its forward passes cost at the curve's prices
  (`costs.priced_seconds`), what this prompt's acceptance should give here without timing noise.
Where another vanilla decoding is faster (another precision, or another kernel form of this one: the routed
kernels, whose rows are not bit-equal alone and batched, or attention one row at a time, faster for one row),
the speed-up against that fastest vanilla is shown as well, estimated from
the load-time measurement: achieved × its seconds per token ÷ the race's. No speed-up comes from a slow baseline.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import plotly.graph_objects as go

from ..config import DecodeConfig
from ..costs import CLOSE_DRIFT, RowCheck, priced_seconds
from ..decoding import GenerationResult
from ..engine import Engine
from ..hardware import hardware_line
from ..planner import Settings, predict
from ..tuning import (COMPILED, INVARIANT, KEYED, PER_ROW, ROUTED, ROUTED_COMPILED, TuneProgress, Tuning, dtype_name,
                      form_of)
from . import figures
from .presets import PAGE_SAMPLING
from .presets import auto_settings
from .render import esc
from .zerogpu import on_zero_gpu

# what a form timed for vanilla alone is
OTHER_FORMS = {ROUTED: "the fastest kernel per row count", PER_ROW: "attention one row at a time",
               INVARIANT: "attention in fixed-shape tiles",
               KEYED: "attention cut by key counts",
               COMPILED: "attention compiled on this machine",
               ROUTED_COMPILED: "the fastest kernel per row count, attention compiled on this machine"}

NOT_MEASURED = "This machine's pass costs were not measured"
ON_ZERO_GPU = ("on ZeroGPU, where a GPU is attached only during a request, so auto keeps its default settings "
               "(k = {k}, prompt lookup {lookup_tokens}, draft tree +{tree_candidates})")


@dataclass
class MachineView:
    """The "This machine" panel: a few lines of HTML and the cost-curve figure, built once per loaded model."""

    html: str
    figure: go.Figure


def fallback_text(chosen: dict) -> str:
    return (f"k = {chosen['k']}, prompt lookup {chosen['lookup_tokens']}, "
            f"draft tree +{chosen['tree_candidates']}")


def not_measured(chosen: dict) -> str:
    return f"{NOT_MEASURED} {ON_ZERO_GPU.format(**chosen)}" if on_zero_gpu() else (
        f"{NOT_MEASURED} when this model loaded: auto keeps its default settings ({fallback_text(chosen)})")


def row_verdict(check: RowCheck, usable: bool) -> str:
    """Whether SDSAT may decode in a precision, and why (tuning.py's rule)."""
    if check.invariant:
        return f"SDSAT may decode in it: all {check.rows} rows checked come out bit-equal alone and batched"
    rounding = (f"rows differ by rounding only (all {check.rows} keep their top token; largest drift "
                f"{check.max_drift:.1e} of the top logit)")
    if check.close and usable:
        return f"SDSAT may decode in it: {rounding}"
    if check.close:
        return f"vanilla only: {rounding}, and a bit-exact form was measured for SDSAT"
    if check.argmax_equal < check.rows:
        why = f"{check.rows - check.argmax_equal} of {check.rows} rows change their top token when batched"
    else:
        why = f"batched rows drift by {check.max_drift:.1e} of the top logit (over {CLOSE_DRIFT:g})"
    return f"vanilla only, not SDSAT: {why}"


def measuring_line(progress: TuneProgress, chosen: dict) -> str:
    """While the machine is measured behind the page: where it stands, and what races use until then."""
    return (f"auto: {progress.line()}. Until the plan is ready, races use the fallback settings "
            f"({fallback_text(chosen)}); this note and This machine fill in when it is.")


def auto_line(tuning: Tuning | None, chosen: dict, greedy: bool = True, measuring: TuneProgress | None = None,
              temperature: float = PAGE_SAMPLING["temperature"], top_p: float = PAGE_SAMPLING["top_p"],
              top_k: int = PAGE_SAMPLING["top_k"]) -> str:
    """One line on what auto chose here and why (the plan's reason, or why there is no plan); for sampling, the
    plan at `temperature`, `top_p` and `top_k` (the page's defaults unless given, as `auto_settings`)."""
    if measuring is not None and tuning is None:
        return measuring_line(measuring, chosen)
    if tuning is None:
        return not_measured(chosen)
    plan = tuning.plan_for(("two_step",), greedy, temperature, top_p, top_k)
    if plan is None:
        return f"auto: {tuning.note}: {fallback_text(chosen)}"
    return f"auto on this machine: {plan.reason}"


def machine_view(engine: Engine) -> MachineView:
    """The hardware, each precision measured (one-token ms, whether SDSAT may use it) and auto's plan, beside
    the cost-curve figure."""
    tuning = engine.tuning
    chosen = auto_settings(tuning, max_k=engine.max_k)
    if on_zero_gpu():  # naming the GPU would start CUDA outside a GPU call
        return MachineView(lines_html([not_measured(chosen)]), figures.empty_figure("Not measured on ZeroGPU"))
    lines = [hardware_line(engine.model)]
    measuring = engine.measuring  # read once: the tuning thread may clear it at any moment
    if tuning is None and measuring is not None:
        lines.append(measuring_line(measuring, chosen))
        return MachineView(lines_html(lines), figures.empty_figure("Measuring this machine…"))
    if tuning is None or not tuning.curves:
        lines.append(not_measured(chosen))
        return MachineView(lines_html(lines), figures.empty_figure("Not measured"))
    fastest, names = tuning.baseline[0], tuning.names
    for precision, curve in tuning.curves.items():
        line = f"{names[precision]}: {1e3 * curve.one_token_s:.1f} ms per one-token pass"
        if names[precision] == fastest:
            line += " (the fastest vanilla here)"
        check = tuning.rows.get(precision)
        lines.append(line + (f" · {row_verdict(check, precision in tuning.usable)}" if check is not None else ""))
    for name, seconds in tuning.vanilla_s.items():  # forms timed for vanilla alone
        lines.append(f"{name}: {1e3 * seconds:.1f} ms per one-token pass"
                     + (" (the fastest vanilla here)" if name == fastest else "")
                     + f" · vanilla only ({OTHER_FORMS.get(name.partition(' ')[2], 'another form')}; SDSAT decodes "
                       f"in {names.get(name.partition(' ')[0], 'another form')})")
    noisy = sorted(p for p, flag in tuning.noisy.items() if flag)
    if noisy:
        lines.append(f"{', '.join(noisy)}: measured while something else used the cores; kept (the page "
                     "measures it again when the machine is quiet, `python -m sdsat tune --force` on request)")
    lines.append(auto_line(tuning, chosen))
    chat_plan = tuning.plan_for(("two_step",), chat=True) if tuning.chat_trace is not None else None
    if chat_plan is not None:  # the Chat tab's, planned over the chat prompts' trace
        lines.append(f"auto for chat: {chat_plan.reason}")
    figure = figures.cost_figure(tuning.curves, names, tuning.usable, dtype_name(engine.model), chosen)
    return MachineView(lines_html(lines), figure)


def lines_html(lines: list[str]) -> str:
    return '<div class="machine">' + "".join(f"<div>{esc(line)}</div>" for line in lines) + "</div>"


@dataclass
class RaceCosts:
    """What this machine's cost curve says about one race (the module's docstring defines each number)."""

    decoding: str  # the precision and kernel form both decoders ran in, e.g. "float32 row-invariant"
    one_token_ms: float  # its one-token pass, as measured at load
    predicted: float | None  # the planner's speed-up for these settings, against vanilla in `decoding`
    implied: float | None  # this race's tokens ÷ its passes' cost in one-token passes
    fastest: str  # the fastest vanilla decoding measured here (precision and form)
    fastest_ms: float
    vs_fastest: float | None  # the achieved speed-up against that vanilla
    estimated: bool  # vs_fastest is estimated (the fastest vanilla is another, not this race's)
    auto: dict = field(default_factory=dict)  # auto's plan for these SATs here, its note, and whether it was used

    def to_dict(self) -> dict:
        """The fields /generate adds (plain data; None where a number could not be had)."""
        return {"predicted_speedup": self.predicted, "implied_speedup": self.implied,
                "fastest_vanilla": {"decoding": self.fastest, "ms_per_token": self.fastest_ms,
                                    "speedup": self.vs_fastest, "estimated": self.estimated},
                "cost_curve": {"decoding": self.decoding, "one_token_ms": self.one_token_ms}, "auto": self.auto}


NO_COSTS = dict.fromkeys(("predicted_speedup", "implied_speedup", "fastest_vanilla", "cost_curve", "auto"))


def race_costs(engine: Engine, config: DecodeConfig, sdsat: GenerationResult, achieved: float,
               chat: bool = False) -> RaceCosts | None:
    """The predicted and implied speed-ups of a finished race, and the achieved one against the fastest
    vanilla measured here; None when this machine was not measured in the race's precision. A `chat` race is
    predicted over the chat trace and compared with chat's plan, where the SATs ship one."""
    tuning, dtype = engine.tuning, dtype_name(engine.model)
    curve = tuning.curves.get(dtype) if tuning is not None else None
    if curve is None or tuning.forms.get(dtype, form_of(engine.model)) != form_of(engine.model):
        return None  # not measured in the numerics this race ran in
    settings = Settings(config.scheme, config.k, config.lookup_tokens, config.tree_candidates)
    sampling, predicted = config.sampling, None
    trace = tuning.trace_for(chat)
    if trace is not None and trace.prompts:
        sampled = None
        if sampling.do_sample:
            sampled = trace.sampled_at(sampling.temperature, sampling.top_p, sampling.top_k)
        predicted = predict(trace, settings, curve, curve.one_token_s, sampled).speedup
    seconds = priced_seconds(sdsat.steps, curve, config.k)
    implied = len(sdsat.token_ids) * curve.one_token_s / seconds if sdsat.token_ids and seconds > 0 else None
    fastest, fastest_s = tuning.baseline
    estimated = fastest_s < curve.one_token_s
    vs_fastest = achieved * fastest_s / curve.one_token_s if estimated else achieved
    plan = tuning.plan_for(("two_step",), not sampling.do_sample, sampling.temperature, sampling.top_p,
                           sampling.top_k, chat)
    auto = {"plan": plan.to_dict() if plan else None, "note": tuning.note,
            "used": plan is not None and asdict(plan.settings) == asdict(settings)}
    decoding = tuning.names.get(dtype, dtype)
    return RaceCosts(decoding=decoding, one_token_ms=1e3 * curve.one_token_s, predicted=_number(predicted),
                     implied=_number(implied), fastest=fastest if estimated else decoding,
                     fastest_ms=1e3 * (fastest_s if estimated else curve.one_token_s),
                     vs_fastest=_number(vs_fastest), estimated=estimated, auto=auto)


def _number(value: float | None) -> float | None:
    """A finite, positive number, else None (a race stopped before its first token)."""
    return value if value is not None and math.isfinite(value) and value > 0 else None
