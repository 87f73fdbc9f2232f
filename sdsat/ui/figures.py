"""Plotly figures of a race (the latency race, accepted tokens, acceptance by position, pass times) and of the
machine it ran on (what a pass costs, measured at load)."""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

from ..costs import CostCurve
from ..decoding import StepRecord
from ..pass_parts import PASS_PARTS, Split
from ..tree import DraftTree
from .render import source_class

COLORS = {"vanilla": "#64748b", "sdsat": "#7c3aed", "verified": "#3b82f6", "draft": "#10b981", "bonus": "#f59e0b",
          "rejected": "#ef4444", "copy": "#0891b2"}

PART_COLORS = ("#7c3aed", "#3b82f6", "#10b981", "#f59e0b", "#0891b2", "#94a3b8")  # a pass's parts, PASS_PARTS' order

PRECISION_COLORS = {"float32": COLORS["sdsat"], "bfloat16": COLORS["copy"], "float16": COLORS["bonus"]}


def _layout(fig: go.Figure, title: str, x: str, y: str, height: int = 340) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)), template="plotly_white", height=height,
        margin=dict(l=50, r=15, t=40, b=90), xaxis_title=x, yaxis_title=y,
        legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0.0), font=dict(size=12))
    return fig


def _curve(steps: Sequence[StepRecord]) -> tuple[list[float], list[int]]:
    """(seconds, tokens so far) at the end of each iteration, from (0, 0)."""
    xs, ys, total = [0.0], [0], 0
    for step in steps:
        total += len(step.tokens)
        xs.append(step.elapsed)
        ys.append(total)
    return xs, ys


def race_figure(vanilla: Sequence[StepRecord], sdsat: Sequence[StepRecord]) -> go.Figure:
    """Tokens generated against wall time; both runs start at 0 on a shared clock."""
    fig = go.Figure()
    for name, steps, label in (("vanilla", vanilla, "vanilla (1 token / pass)"), ("sdsat", sdsat, "SDSAT")):
        xs, ys = _curve(steps)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers" if name == "sdsat" else "lines",
                                 line=dict(color=COLORS[name], width=3, shape="hv"), marker=dict(size=5),
                                 name=label, hovertemplate="%{y} tokens at %{x:.2f} s<extra>" + label + "</extra>"))
    return _layout(fig, "Latency race: tokens vs wall time (both runs on one clock)", "seconds", "tokens")


def accepted_figure(steps: Sequence[StepRecord]) -> go.Figure:
    """Tokens emitted per iteration, split by source (the bonus token counted)."""
    fig = go.Figure()
    iters = [s.index + 1 for s in steps]
    labels = {"verified": "t (step 1)", "draft": "accepted drafts", "copy": "accepted prompt-lookup copies",
              "bonus": "bonus (step 2)"}
    copied = any(s.draft_source == "lookup" for s in steps)
    for source, label in labels.items():
        if source == "copy" and not copied:
            continue  # prompt lookup was off
        counts = [sum(source_class(s, src) == source for src in s.sources) for s in steps]
        fig.add_trace(go.Bar(x=iters, y=counts, name=label, marker_color=COLORS[source]))
    if steps:
        mean = sum(len(s.tokens) for s in steps) / len(steps)
        fig.add_hline(y=mean, line=dict(color="#111827", dash="dot"),
                      annotation_text=f"mean {mean:.2f} tokens / iteration", annotation_position="top left")
    fig.update_layout(barmode="stack", bargap=0.15)
    return _layout(fig, "Tokens per iteration (bonus counted)", "iteration", "tokens")


def position_figure(acceptance: Sequence[float]) -> go.Figure:
    """Acceptance rate per draft position."""
    positions = [f"d{i}" for i in range(1, len(acceptance) + 1)]
    fig = go.Figure(go.Bar(x=positions, y=[100 * a for a in acceptance], marker_color=COLORS["draft"],
                           text=[f"{100 * a:.0f}%" for a in acceptance], textposition="outside",
                           hovertemplate="%{x}: %{y:.0f}% accepted<extra></extra>"))
    fig.update_yaxes(range=[0, 110])
    return _layout(fig, "Acceptance rate per draft position", "draft position", "% of iterations")


def pass_figure(vanilla: Sequence[StepRecord], sdsat: Sequence[StepRecord]) -> go.Figure:
    """Wall time of every forward pass; the first pass of each run also reads the prompt (prefill)."""
    fig = go.Figure()
    two = [s for s in sdsat if len(s.pass_seconds) > 1]
    series = [("vanilla: 1 token", [s.pass_seconds[0] for s in vanilla], COLORS["vanilla"]),
              ("SDSAT step 1: draft [c, SAT×k]", [s.pass_seconds[0] for s in two], COLORS["verified"]),
              ("SDSAT step 2: verify [t, d1..dk]", [s.pass_seconds[1] for s in two], COLORS["sdsat"])]
    lookup = [s.pass_seconds[0] for s in sdsat if len(s.pass_seconds) == 1]  # copies verified without a draft pass
    if lookup:
        series.append(("SDSAT prompt lookup: verify [c, copies]", lookup, COLORS["copy"]))
    for label, seconds, color in series:
        ms = [1e3 * s for s in seconds]
        fig.add_trace(go.Scatter(x=list(range(1, len(ms) + 1)), y=ms, mode="markers", name=label,
                                 marker=dict(color=color, size=6),
                                 hovertemplate="pass %{x}: %{y:.0f} ms<extra>" + label + "</extra>"))
    tail = [1e3 * s for st in list(vanilla)[1:] + list(sdsat)[1:] for s in st.pass_seconds]
    if tail:  # keep the prefill pass from squashing the rest
        top = sorted(tail)[int(0.98 * (len(tail) - 1))] * 1.6
        fig.update_yaxes(range=[0, top])
    return _layout(fig, "Time per forward pass (pass 1 reads the prompt; may be off the chart)",
                   "pass number within its kind", "ms")


def chosen_widths(curve: CostCurve, k: int, lookup_tokens: int, tree_candidates: int) -> list[tuple[str, int, float]]:
    """(pass, tokens fed, cost ÷ a one-token pass) of each pass kind these settings run."""
    verify = 1 + len(DraftTree.for_k(k, tree_candidates).paths)
    tree = f", {tree_candidates} runner-ups" if tree_candidates else ""
    out = [(f"draft pass [t, SAT×{k}]", k + 1, curve.draft_s(k) / curve.one_token_s),
           (f"verify pass [t, {k} drafts{tree}]", verify, curve.tree_s(k, tree_candidates) / curve.one_token_s)]
    if lookup_tokens:
        out.append((f"prompt-lookup verify [t, up to {lookup_tokens} copies]", 1 + lookup_tokens,
                    curve.pass_s(1 + lookup_tokens) / curve.one_token_s))
    return out


def cost_figure(curves: dict[str, CostCurve], names: dict[str, str], usable: Sequence[str], dtype: str,
                chosen: dict) -> go.Figure:
    """What a pass costs ÷ the same precision's one-token pass, against the tokens it feeds: a line per precision
    measured (`names`: how to call each, e.g. with its kernel form), its draft passes [t, SAT×k] at k + 1, and the
    passes of the `chosen` settings in `dtype`."""
    fig = go.Figure()
    for precision, curve in curves.items():
        color = PRECISION_COLORS.get(precision, COLORS["vanilla"])
        use = "SDSAT and vanilla" if precision in usable else "vanilla only"
        name = f"{names.get(precision, precision)}: {1e3 * curve.one_token_s:.1f} ms at 1 token ({use})"
        relative = curve.relative()
        fig.add_trace(go.Scatter(x=list(relative), y=list(relative.values()), mode="lines+markers", name=name,
                                 line=dict(color=color, width=2), marker=dict(size=5),
                                 hovertemplate="%{x} tokens: %{y:.2f}× one token<extra>" + precision + "</extra>"))
        drafts = sorted(curve.draft)
        fig.add_trace(go.Scatter(x=[k + 1 for k in drafts], y=[curve.draft[k] / curve.one_token_s for k in drafts],
                                 mode="markers", name=f"{precision}: draft passes [t, SAT×k]", customdata=drafts,
                                 marker=dict(color=color, size=8, symbol="diamond-open", line=dict(width=2)),
                                 hovertemplate="k = %{customdata}: %{y:.2f}× one token<extra>draft pass</extra>"))
    if dtype in curves:
        points = chosen_widths(curves[dtype], chosen["k"], chosen["lookup_tokens"], chosen["tree_candidates"])
        fig.add_trace(go.Scatter(x=[w for _, w, _ in points], y=[c for _, _, c in points], mode="markers",
                                 name=f"these settings' passes ({dtype})", hovertext=[label for label, _, _ in points],
                                 marker=dict(color="rgba(0,0,0,0)", size=15, line=dict(color="#111827", width=2)),
                                 hovertemplate="%{hovertext}: %{x} tokens, %{y:.2f}× one token<extra></extra>"))
    fig.add_hline(y=1.0, line=dict(color="#94a3b8", dash="dot"))
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, "What a forward pass costs here (as measured on this machine)", "tokens per pass",
                   "× a one-token pass", height=380)


def split_figure(splits: dict[str, Split], context: int) -> go.Figure:
    """One horizontal bar per pass, stacked by part, in ms."""
    labels = list(splits)[::-1]  # plotly draws the first category at the bottom
    fig = go.Figure()
    for part, color in zip(PASS_PARTS, PART_COLORS):
        fig.add_trace(go.Bar(y=labels, x=[1e3 * splits[label].parts[part] for label in labels], name=part,
                             orientation="h", marker_color=color))
    fig.update_layout(barmode="stack")
    _layout(fig, f"Where a pass's time goes here ({context} tokens cached)", "ms per pass", "",
            height=140 + 45 * len(labels))
    fig.update_layout(margin=dict(l=330))
    return fig


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=13, color="#6b7280"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "", "", "", height=220)
