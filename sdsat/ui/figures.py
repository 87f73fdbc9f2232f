"""Plotly figures of a race: the latency race, accepted tokens, acceptance by position, pass times."""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

from ..decoding import StepRecord
from .render import source_class

COLORS = {"vanilla": "#64748b", "sdsat": "#7c3aed", "verified": "#3b82f6", "draft": "#10b981", "bonus": "#f59e0b",
          "rejected": "#ef4444", "copy": "#0891b2"}


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


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=13, color="#6b7280"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "", "", "", height=220)
