"""The Benchmark tab: the project's own results, read from files in assets/bench/ (never recomputed here).

The tab leads with one chart, the median speed-up against vanilla per suite and method, each suite
labelled with the machine it was measured on; each suite's table and files sit folded under it.
It is built once when the app starts (`bench_page`), not per visitor.

What it reads (the format `python -m sdsat.bench` writes): each suite folder's `summary.json` (a list
of result rows, or an object with a "rows" / "results" list; its other fields, such as machine, model
and notes, are shown under the table) and its result files (`results.md`, `results.json`, the
interactive `.html` figures), which are offered for download under names that start with the suite.
`assets/bench/` itself holds the suite "humaneval-16"; sub-folders with their own summary.json are
further suites, in the order of SUITES.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import ASSETS
from .render import esc

BENCH_DIR = ASSETS / "bench"
SUMMARY = "summary.json"
DOWNLOADS = (".md", ".json", ".html", ".csv")
SPEEDUP = "speed-up vs vanilla (median)"
FASTEST = "speed-up vs fastest vanilla (median)"  # suites that ran vanilla in every precision and form

# folder (relative to assets/bench) -> (file-name prefix, title); the current suites first
OLDER = " (older: float32 vanilla, before auto)"
STAGE1, STAGE2, STAGE3 = " (the stage-1 adapter)", " (the stage-2 adapter)", " (the stage-3 adapter)"
SUITES = {"stage4-humaneval-16-35": ("stage4-humaneval-16-35",
                                     "HumanEval 16–35 (held out), auto against the fastest vanilla"),
          "stage4-heldout-code": ("stage4-heldout-code", "Held-out code prompts, auto against the fastest vanilla"),
          "stage4-sampling-humaneval-16-35-t07": ("stage4-sampling-humaneval-16-35-t07",
                                                  "Sampling at T=0.7, top-p 0.95: HumanEval 16–35, auto against "
                                                  "the fastest vanilla and vanilla sampling"),
          "stage4-sampling-heldout-chat-t07": ("stage4-sampling-heldout-chat-t07",
                                               "Sampling at T=0.7, top-p 0.95: held-out chat prompts, auto against "
                                               "the fastest vanilla and vanilla sampling"),
          "stage4-sampling-humaneval-16-35-t1-sampled-copies": (
              "stage4-sampling-humaneval-16-35-t1-sampled-copies",
              "Sampling at T=1: HumanEval 16–35, auto (planned on sampled text) against its earlier plan, the "
              "fastest vanilla and vanilla sampling"),
          "stage4-sampling-humaneval-16-35-t1": ("stage4-sampling-humaneval-16-35-t1",
                                                 "Sampling at T=1: HumanEval 16–35, auto (planned on greedy text) "
                                                 "against the fastest vanilla and vanilla sampling"),
          "stage3-humaneval-16-35": ("stage3-humaneval-16-35",
                                     "HumanEval 16–35 (held out), auto against the fastest vanilla" + STAGE3),
          "stage3-heldout-code": ("stage3-heldout-code",
                                  "Held-out code prompts, auto against the fastest vanilla" + STAGE3),
          "stage3-chat-16": ("stage3-chat-16", "Chat prompts, all 16, auto against the fastest vanilla" + STAGE3),
          "stage3-sampling-humaneval-16-35-t07": ("stage3-sampling-humaneval-16-35-t07",
                                                  "Sampling at T=0.7, top-p 0.95: HumanEval 16–35, auto against "
                                                  "vanilla sampling" + STAGE3),
          "stage3-sampling-heldout-chat-t07": ("stage3-sampling-heldout-chat-t07",
                                               "Sampling at T=0.7, top-p 0.95: held-out chat prompts, auto against "
                                               "vanilla sampling" + STAGE3),
          "stage3-sampling-humaneval-16-35-t1": ("stage3-sampling-humaneval-16-35-t1",
                                                 "Sampling at T=1: HumanEval 16–35, auto against vanilla sampling"
                                                 + STAGE3),
          "stage2-humaneval-16-35": ("stage2-humaneval-16-35",
                                     "HumanEval 16–35 (held out), auto against the fastest vanilla" + STAGE2),
          "stage2-heldout-code": ("stage2-heldout-code",
                                  "Held-out code prompts, auto against the fastest vanilla" + STAGE2),
          "trees-humaneval-0-15": ("auto-humaneval-0-15",
                                   "HumanEval 0–15, auto against the fastest vanilla" + STAGE1),
          "final-humaneval-16-35": ("auto-humaneval-16-35",
                                    "HumanEval 16–35 (held out), auto against the fastest vanilla" + STAGE1),
          "gpu-h200-float32": ("gpu-h200-float32", "HumanEval 0–7 on an NVIDIA H200 GPU, float32" + STAGE1),
          "sampling-fastest-humaneval-16-25-t07": ("sampling-fastest-humaneval-16-25-t07",
                                                   "Sampling at T=0.7, top-p 0.95: HumanEval 16–25, auto against "
                                                   "the fastest vanilla" + STAGE1),
          "sampling-fastest-heldout-code-t07": ("sampling-fastest-heldout-code-t07",
                                                "Sampling at T=0.7, top-p 0.95: held-out code prompts, auto against "
                                                "the fastest vanilla" + STAGE1),
          "sampling-humaneval-16-35-t07": ("sampling-humaneval-16-35-t07",
                                           "Sampling at T=0.7, top-p 0.95: HumanEval 16–35, chain and draft trees"
                                           + STAGE1),
          "sampling-chat-t07": ("sampling-chat-t07", "Sampling at T=0.7, top-p 0.95: held-out chat prompts" + STAGE1),
          "sampling-humaneval-16-35-t1": ("sampling-humaneval-16-35-t1", "Sampling at T=1: HumanEval 16–35" + STAGE1),
          "sampling-humaneval-16-35-t1-auto": ("sampling-humaneval-16-35-t1-auto",
                                               "Sampling at T=1: HumanEval 16–35, auto after the re-measured trace"
                                               + STAGE1),
          "humaneval-164": ("humaneval-164", "HumanEval, all 164 problems" + OLDER),
          "": ("humaneval-16", "HumanEval problems 0–15, every method" + OLDER),
          "humaneval-256": ("humaneval-16-256tok", "HumanEval problems 0–15, 256 new tokens" + OLDER),
          "chat-16": ("chat-16", "Chat prompts, all 16" + OLDER),
          "chat": ("chat-6", "Chat prompts 1–6, every method" + OLDER)}
# The chart's methods (benchmark row names; "auto" matches "sdsat_greedy auto (…)") and what the chart calls
# them; other rows stay in the tables.
CHART_METHODS = {"prompt_lookup k=10": "prompt lookup (transformers, 10 tokens)",
                 "sdsat_greedy k=3": "SDSAT, the paper's two-step (k=3)",
                 "sdsat_greedy k=3 +tree": "SDSAT + draft tree (k=3)",
                 "sdsat_greedy k=3 +lookup+tree": "SDSAT + prompt lookup + draft tree (k=3)",
                 "sdsat_greedy auto": "SDSAT auto (settings measured for the machine)"}
CHART_COLOURS = ["#94a3b8", "#a78bfa", "#34d399", "#7c3aed", "#f59e0b"]


@dataclass
class Suite:
    """One benchmark run: its table as HTML, its notes, and its files renamed for download."""

    key: str  # file-name prefix, e.g. "humaneval-164"
    title: str
    machine: str  # as summary.json records it, "" when it does not
    rows: list[dict]
    html: str  # the formatted table and the notes
    downloads: list[str] = field(default_factory=list)


@dataclass
class BenchPage:
    """Everything the Benchmark tab shows, built once."""

    intro: str  # the sentence on where the numbers come from (markdown)
    figure: object | None  # the plotly chart, None without results
    suites: list[Suite]
    message: str = ""  # HTML shown instead of the chart when there are no results


def _rows_of(summary) -> tuple[list[dict], dict]:
    if isinstance(summary, list):
        return [r for r in summary if isinstance(r, dict)], {}
    if isinstance(summary, dict):
        for key in ("rows", "results", "runs"):
            if isinstance(summary.get(key), list):
                notes = {k: v for k, v in summary.items() if k != key}
                return [r for r in summary[key] if isinstance(r, dict)], notes
        return [], summary
    return [], {}


def cell(column: str, value) -> str:
    """A table value as text: speed-ups as "1.63×", rates to one decimal, lists as their first five values."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if "speed-up" in column or "speedup" in column:
            return f"{value:.2f}×"
        if "tokens/s" in column:
            return f"{value:.1f}"
        if isinstance(value, int):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, list):
        shown = " · ".join(f"{v:.2f}" if isinstance(v, float) else cell("", v) for v in value[:5])
        return shown + (" …" if len(value) > 5 else "")
    if isinstance(value, dict):
        return esc(", ".join(f"{k}: {v}" for k, v in value.items()))
    return esc(str(value))


def _empty(value) -> bool:
    return value in (None, "", "–", "-", 0, 0.0)


def table_html(rows: list[dict]) -> str:
    """The rows as a table; columns empty (0 or –) in every row are left out and named below it."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    empty = [c for c in columns if c != "method" and all(_empty(r.get(c)) for r in rows)]
    columns = [c for c in columns if c not in empty]
    head = "".join(f"<th>{esc(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(str(c), r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    note = (f'<div class="muted bench-left-out">Left out, 0 or – in every row: {esc(", ".join(empty))}.</div>'
            if empty else "")
    return f'<div class="bench-scroll"><table class="bench-table"><tr>{head}</tr>{body}</table></div>{note}'


def _note(key, value) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        inner = "".join(f"<li>{esc(v.lstrip('- '))}</li>" for v in value)
        return f"<li><b>{esc(str(key))}</b><ul>{inner}</ul></li>"
    if key == "command":
        return f"<li><b>command</b>: <code>{esc(str(value))}</code></li>"
    return f"<li><b>{esc(str(key))}</b>: {cell(str(key), value)}</li>"


def load_suite(folder: Path, key: str, title: str, download_dir: Path | None = None) -> Suite | None:
    """The suite in `folder`, or None when it has no summary.json; an unreadable one says so."""
    path = folder / SUMMARY
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return Suite(key, title, "", [],
                     f'<div class="check bad">{esc(str(path.name))} is unreadable: {esc(str(err))}</div>')
    rows, notes = _rows_of(summary)
    machine = str(notes.get("machine", "")) if isinstance(notes, dict) else ""
    parts = [table_html(rows)] if rows else ['<div class="check info">summary.json holds no rows.</div>']
    if notes:
        parts.append(f'<ul class="bench-notes">{"".join(_note(k, v) for k, v in notes.items())}</ul>')
    suite = Suite(key, title, machine, rows, "".join(parts))
    if download_dir is not None:
        download_dir.mkdir(parents=True, exist_ok=True)
        for file in sorted(folder.iterdir()):
            if file.is_file() and file.suffix in DOWNLOADS:
                target = download_dir / f"{key}-{file.name}"
                shutil.copyfile(file, target)
                suite.downloads.append(str(target))
    return suite


def short_machine(machine: str) -> str:
    """"AMD EPYC (flags: …), 2 cores, 2 torch threads, cpu float32, …" -> "AMD EPYC, 2 cores"; a GPU run's
    "…, cuda:0 float32, …" -> "GPU (cuda:0 float32)" (its host CPU is not what was measured)."""
    if not machine:
        return "machine not recorded"
    parts = re.sub(r" \(flags:[^)]*\)", "", machine).split(", ")
    gpu = [p for p in parts if p.startswith("cuda")]
    return f"GPU ({gpu[0]})" if gpu else ", ".join(parts[:2])


def _chart_row(rows: list[dict], method: str) -> dict | None:
    return next((r for r in rows if r.get("method") == method or str(r.get("method", "")).startswith(method + " (")),
                None)


def _speedup(row: dict):
    """Against the fastest vanilla where the suite measured several, else against its vanilla."""
    value = row.get(FASTEST)
    return value if isinstance(value, (int, float)) else row.get(SPEEDUP)


def speedup_figure(suites: list[Suite]):
    """Horizontal grouped bars: the median speed-up against vanilla per suite (its machine under its name)
    and method. Horizontal, so that suite names and values stay readable at phone width."""
    import plotly.graph_objects as go

    figure = go.Figure()
    labels = [f"{s.key}<br><sub>{esc(short_machine(s.machine))}</sub>" for s in suites]
    for (method, name), colour in zip(CHART_METHODS.items(), CHART_COLOURS):
        suite_labels, values, hover = [], [], []
        for suite, label in zip(suites, labels):
            row = _chart_row(suite.rows, method)
            if row is None or not isinstance(_speedup(row), (int, float)):
                continue
            suite_labels.append(label)
            values.append(_speedup(row))
            rate = row.get("tokens/s")
            hover.append(f"{esc(suite.title)}<br>{esc(suite.machine or 'machine not recorded')}"
                         + (f"<br>{rate:.1f} tokens/s" if isinstance(rate, (int, float)) else ""))
        if values:
            figure.add_bar(y=suite_labels, x=values, orientation="h", name=name, marker_color=colour,
                           text=[f"{v:.2f}×" for v in values], textposition="outside", cliponaxis=False,
                           hovertext=hover, hovertemplate="%{hovertext}<br>%{x:.2f}× vanilla<extra></extra>")
    top = max([v for trace in figure.data for v in trace.x] + [1.0])
    figure.add_vline(x=1.0, line_dash="dash", line_color="#475569")
    figure.update_layout(
        # The title sits on the plot, below the top strip where plotly's toolbar appears (over it on a phone).
        title=dict(text="Speed-up against vanilla", x=0.01, y=1, yref="paper", yanchor="bottom", pad=dict(b=8),
                   font=dict(size=15)),
        barmode="group", bargap=0.25, height=560, template="plotly_white",
        xaxis=dict(title="× vanilla tokens/s (median over prompts; the fastest vanilla where several ran)",
                   range=[0, 1.15 * top]),
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=labels),
        margin=dict(l=10, r=10, t=64, b=10),
        legend=dict(orientation="h", yanchor="top", y=-0.12, x=0, traceorder="normal"))
    return figure


def bench_page(folder: Path = BENCH_DIR, suites: dict[str, tuple[str, str]] = SUITES,
               download_dir: Path | None = None) -> BenchPage:
    """The Benchmark tab, read from `folder`; result files are copied into `download_dir` under suite names."""
    download_dir = download_dir or Path(tempfile.mkdtemp(prefix="sdsat-bench-"))
    found = [s for name, (key, title) in suites.items()
             if (s := load_suite(folder / name, key, title, download_dir / key)) is not None]
    machines = sorted({short_machine(s.machine) for s in found if s.machine})
    intro = ("These numbers were measured on "
             + (" and ".join(machines) if machines else "the machines each suite names")
             + " by the project's benchmark (`assets/bench/`, not recomputed here); a different CPU can give "
             "different speed-ups. The **Race** tab measures your own run, on the machine serving this page.")
    if not found:
        return BenchPage(intro, None, [], '<div class="check info">No benchmark results yet. They appear here once the '
                                          "project's benchmark has written <code>assets/bench/summary.json</code>."
                                          "</div>")
    return BenchPage(intro, speedup_figure(found), found)
