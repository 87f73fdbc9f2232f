"""The Benchmark tab: the project's own results, read from files in assets/bench/ (never recomputed here).

What it reads (the format `python -m sdsat.bench` writes): `summary.json` (a list of result rows, or
an object with a "rows" / "results" list; its other fields, such as machine, model and notes, are
shown under the table), every `NAME.png` as an image, every standalone plotly `NAME.html` without a
PNG twin as an embedded, sandboxed frame, and every plotly figure saved as `NAME.json` (an object
with "data" and "layout") as a native plot. `results.md` and other tables are offered for download.
A sub-folder with its own summary.json (`assets/bench/humaneval-164/`, `chat/`, `chat-16/`,
`humaneval-256/`) is a further suite, shown under its own heading in the order of SUITES.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .. import ASSETS
from .render import esc

BENCH_DIR = ASSETS / "bench"
SUMMARY = "summary.json"
_MAX_FIGURE_BYTES = 5_000_000


@dataclass
class BenchView:
    html: str  # the summary table and notes, or the 'no results yet' message
    images: list[str] = field(default_factory=list)  # PNG paths
    figures: list = field(default_factory=list)  # plotly figures
    downloads: list[str] = field(default_factory=list)  # other result files
    frames: str = ""  # standalone HTML figures, each in a sandboxed iframe


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


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, (list, dict)):
        text = json.dumps(value)
        return esc(text if len(text) < 80 else text[:77] + "…")
    return esc(str(value))


def table_html(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{esc(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    return f'<div class="bench-scroll"><table class="bench-table"><tr>{head}</tr>{body}</table></div>'


def load_bench(folder: Path = BENCH_DIR) -> BenchView:
    summary_path = folder / SUMMARY
    if not summary_path.is_file():
        return BenchView('<div class="check info">No benchmark results yet. They appear here once the project\'s '
                         'benchmark has written <code>assets/bench/summary.json</code> and its figures.</div>')
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return BenchView(f'<div class="check bad">assets/bench/summary.json is unreadable: {esc(str(err))}</div>')
    rows, notes = _rows_of(summary)
    parts = [table_html(rows)] if rows else []
    if notes:
        parts.append(f'<ul class="bench-notes">{"".join(_note(k, v) for k, v in notes.items())}</ul>')
    view = BenchView("".join(parts) or '<div class="check info">summary.json holds no rows.</div>')
    frames = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".png":
            view.images.append(str(path))
        elif path.suffix == ".html" and not path.with_suffix(".png").is_file() and path.stat().st_size < _MAX_FIGURE_BYTES:
            # The benchmark's own file; sandboxed anyway, and escaped so it stays one attribute value.
            frames.append(f'<iframe class="bench-frame" sandbox="allow-scripts" title="{esc(path.stem)}" '
                          f'srcdoc="{esc(path.read_text(errors="replace"))}"></iframe>')
        elif path.suffix == ".json" and path.name != SUMMARY and path.stat().st_size < _MAX_FIGURE_BYTES:
            figure = _plotly_figure(path)
            if figure is not None:
                view.figures.append(figure)
        if path.suffix in (".html", ".md", ".csv"):
            view.downloads.append(str(path))
    view.frames = "".join(frames)
    return view


SUITES = {"humaneval-164": "HumanEval, all 164 problems (the fastest settings)",
          "": "HumanEval problems 0–15 (every method)", "chat": "Chat prompts 1–6 (every method)",
          "chat-16": "Chat prompts, all 16 (the fastest settings)",
          "humaneval-256": "HumanEval problems 0–15, 256 new tokens (the fastest settings)"}


def load_suites(folder: Path = BENCH_DIR, suites: dict[str, str] = SUITES) -> BenchView:
    """Every suite that has results, each under its own heading, in one view."""
    views = [(title, load_bench(folder / name)) for name, title in suites.items() if (folder / name / SUMMARY).is_file()]
    if len(views) <= 1:
        return views[0][1] if views else load_bench(folder)
    merged = BenchView("")
    for title, view in views:
        merged.html += f'<h3 class="bench-suite">{esc(title)}</h3>{view.html}'
        merged.images += view.images
        merged.figures += view.figures
        merged.downloads += view.downloads
        merged.frames += view.frames
    return merged


def _note(key, value) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        inner = "".join(f"<li>{esc(v)}</li>" for v in value)
        return f"<li><b>{esc(str(key))}</b><ul>{inner}</ul></li>"
    if key == "command":
        return f"<li><b>command</b>: <code>{esc(str(value))}</code></li>"
    return f"<li><b>{esc(str(key))}</b>: {_cell(value)}</li>"


def _plotly_figure(path: Path):
    import plotly.io as pio

    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "data" in data and "layout" in data:
            return pio.from_json(json.dumps(data))
    except (OSError, ValueError):
        pass
    return None
