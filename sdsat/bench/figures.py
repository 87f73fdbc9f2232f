"""Plotly figures of a results payload: speed-up against k (the paper's figure), tokens/s per method,
and acceptance per draft position. They are built from the saved JSON, so the app can redraw them.

PNG export goes through kaleido, which drives a Chrome / Chromium it finds on the machine (Debian's
`chromium` package works; `make browser` installs it). Without one, the HTML files are still written.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from .methods import AUTO, RECIPES, label_of
from .stats import variant_key

PNG_ATTEMPTS = 2  # a failed PNG export is tried once more (_write_png says why)
_LAYOUT = dict(template="plotly_white", width=900, height=520, margin=dict(l=70, r=30, t=90, b=60))


class PngExportError(RuntimeError):
    """Static images could not be written (kaleido or a Chrome / Chromium is missing)."""


def _subtitle(payload: dict) -> str:
    meta = payload["meta"]
    m = meta["machine"]
    return (f"{meta['model']['name']} · {meta['source']}, {len(payload['prompts'])} prompts, "
            f"≤{meta['settings']['max_new_tokens']} tokens · {m['device']} {m['dtype']}, "
            f"{m['cores_available']} cores · {meta['date'][:10]}")


def _title(text: str, payload: dict) -> dict:
    return dict(text=f"{text}<br><sup>{_subtitle(payload)}</sup>")


def speedup_vs_k(payload: dict) -> go.Figure:
    """Median speed-up over vanilla against k for SDSAT; the other methods as horizontal lines."""
    rows = payload["summary"]["variants"]
    fig = go.Figure()
    for recipe in RECIPES:
        greedy = sorted((r for r in rows if r["method"] == "sdsat_greedy" and r.get("scheme", "two_step") == recipe),
                        key=lambda r: r["k"])
        if not greedy:
            continue
        fig.add_trace(go.Scatter(
            x=[r["k"] for r in greedy], y=[r["median_speedup"] for r in greedy], mode="lines+markers",
            name=label_of("sdsat_greedy", 0, None, recipe),
            customdata=[[r["tokens_per_forward_pass"], r["mean_tokens_per_iteration"]] for r in greedy],
            hovertemplate="k=%{x}<br>speed-up %{y:.2f}×<br>tokens/forward pass %{customdata[0]:.2f}"
                          "<br>tokens/iteration %{customdata[1]:.2f}<extra></extra>"))
    for row in rows:  # single settings: sampling, and the auto recipe's choice
        if (row["method"] == "sdsat_sample" or row.get("scheme") == AUTO) and row["median_speedup"] is not None:
            fig.add_trace(go.Scatter(x=[row["k"]], y=[row["median_speedup"]], mode="markers", name=row["label"],
                                     marker=dict(symbol="diamond", size=11)))
    dashes = {"vanilla": "solid", "generate": "dot", "prompt_lookup": "dash"}
    sides = {"vanilla": "bottom left", "generate": "top right", "prompt_lookup": "top left"}  # vanilla and
    for row in rows:  # generate sit at ~1.00x: their labels go to opposite corners so they do not overlap
        if row["method"] in dashes and row["median_speedup"] is not None:
            fig.add_hline(y=row["median_speedup"], line_dash=dashes[row["method"]], line_color="gray",
                          annotation_text=f"{row['label']} {row['median_speedup']:.2f}×",
                          annotation_position="bottom right" if row.get("precision") else sides[row["method"]])
    fig.update_layout(title=_title("Speed-up over vanilla decoding against k (drafts per step)", payload),
                      xaxis_title="k (adaptive tokens per step)", yaxis_title="median speed-up (×)",
                      xaxis=dict(dtick=1), yaxis_rangemode="tozero", **_LAYOUT)
    return fig


def tokens_per_second(payload: dict) -> go.Figure:
    """Per-prompt tokens/s of every method and setting, as box plots."""
    fig = go.Figure()
    for row in payload["summary"]["variants"]:
        values = [r["tokens_per_second"] for r in payload["runs"] if variant_key(r) == variant_key(row)]
        fig.add_trace(go.Box(y=values, name=row["label"], boxpoints="all", jitter=0.4, pointpos=0,
                             marker=dict(size=4), showlegend=False))
    fig.update_layout(title=_title("Tokens per second, one point per run", payload),
                      yaxis_title="tokens / s", yaxis_rangemode="tozero", **_LAYOUT)
    return fig


def acceptance_by_position(payload: dict) -> go.Figure:
    """Acceptance rate per draft position, one line per SDSAT setting."""
    fig = go.Figure()
    for row in payload["summary"]["variants"]:
        if row["method"].startswith("sdsat") and row["acceptance_by_position"]:
            acc = row["acceptance_by_position"]
            fig.add_trace(go.Scatter(x=list(range(1, len(acc) + 1)), y=acc, mode="lines+markers", name=row["label"],
                                     customdata=row["drafted_by_position"],
                                     hovertemplate="position %{x}: %{y:.2%} of %{customdata} drafts<extra></extra>"))
    fig.update_layout(title=_title("Acceptance rate per draft position", payload),
                      xaxis_title="draft position i", yaxis_title="share of iterations accepting draft i",
                      xaxis=dict(dtick=1), yaxis=dict(range=[-0.03, 1.03], tickformat=".0%"), **_LAYOUT)
    return fig


FIGURES = {"speedup_vs_k": speedup_vs_k, "tokens_per_second": tokens_per_second,
           "acceptance_by_position": acceptance_by_position}


def build_figures(payload: dict) -> dict[str, go.Figure]:
    return {name: make(payload) for name, make in FIGURES.items()}


def write_figures(figures: dict[str, go.Figure], out_dir: str | Path, png: bool = True,
                  plotlyjs: str = "cdn") -> tuple[list[Path], str | None]:
    """Write NAME.html (and NAME.png) per figure; returns (paths written, why PNGs were skipped or None)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, fig in figures.items():
        path = out_dir / f"{name}.html"
        fig.write_html(path, include_plotlyjs=plotlyjs)
        written.append(path)
    if not png:
        return written, "PNG export turned off"
    try:
        for name, fig in figures.items():
            path = out_dir / f"{name}.png"
            _write_png(fig, path)
            written.append(path)
    except PngExportError as err:
        return written, str(err)
    return written, None


def _write_png(fig: go.Figure, path: Path) -> None:
    try:
        import kaleido  # noqa: F401  (plotly finds it itself; imported here to fail with a clear message)
    except ImportError as err:
        raise PngExportError("PNG export needs kaleido: pip install kaleido") from err
    for attempt in range(PNG_ATTEMPTS):
        try:
            fig.write_image(path, scale=2)
            return
        except (RuntimeError, ValueError, OSError) as err:
            # On a busy machine kaleido's browser page can be asked to render before its script has loaded
            # ("kaleido_scopes is not defined"); a new browser then renders it.
            if attempt + 1 < PNG_ATTEMPTS:
                continue
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PngExportError(f"PNG export failed (kaleido needs a Chrome or Chromium, e.g. `apt-get install "
                                 f"chromium`): {first}") from err

