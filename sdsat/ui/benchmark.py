"""The Benchmark tab: the project's own results, read from files in assets/bench/ (never recomputed here).

The tab leads with one chart of the current suites, the median speed-up against the fastest vanilla per
suite and method, each suite labelled with the machine it was measured on; each suite's table and files
sit folded under it, and older suites are folded under a history. It is built once when the app starts
(`bench_page`), not per visitor.

Which suites, and in which order, is `assets/bench/suites.json`: the latest suite per question ("current"),
then every other ("history", shown newest first). Each entry names its folder, the adapter it measured and
a short note; the rest of its title (prompts, decoding, machine) is read from the folder's own
`summary.json` (the format `python -m sdsat.bench` writes: a list of result rows, or an object with a
"rows" / "results" list; its other fields are shown under the table), so no title can name another
folder's run. The result files (`results.md`, `results.json`, the interactive `.html` figures) are offered
for download under names that start with the folder.

`python -m sdsat.ui.benchmark --readme` prints the README's results table from the current suites that
carry a `readme` label: the one place its figures come from.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import ASSETS
from .render import esc

BENCH_DIR = ASSETS / "bench"
SUITES_FILE = "suites.json"
SUMMARY = "summary.json"
DOWNLOADS = (".md", ".json", ".html", ".csv")
SPEEDUP = "speed-up vs vanilla (median)"
FASTEST = "speed-up vs fastest vanilla (median)"  # suites that ran vanilla in every precision and form
VS_SAMPLING = "speed-up vs vanilla_sample (median)"  # sampled methods against vanilla sampling, same settings
VS_LOOKUP = "speed-up vs prompt_lookup"

PROMPT_FILES = {"chat.jsonl": "chat prompts", "heldout_chat.jsonl": "held-out chat prompts",
                "heldout_code.jsonl": "held-out code prompts"}
GREEDY_METHODS = {"generate", "prompt_lookup", "sdsat_greedy"}

# The chart's methods and what it calls them; other rows stay in the tables. A row's method is matched with
# its temperature left out and sdsat_greedy / sdsat_sample both read as "sdsat" ("auto" matches
# "sdsat_greedy auto (…)" and "sdsat_sample T=0.7 auto (…)").
CHART_METHODS = {"vanilla_sample": "vanilla sampling (same settings)",
                 "prompt_lookup k=10": "prompt lookup (transformers, 10 tokens)",
                 "sdsat k=3": "SDSAT, the paper's two-step (k=3)",
                 "sdsat k=3 +tree": "SDSAT + draft tree (k=3)",
                 "sdsat k=3 +lookup+tree": "SDSAT + prompt lookup + draft tree (k=3)",
                 "sdsat auto": "SDSAT auto (settings measured for the machine)"}
CHART_COLOURS = ["#cbd5e1", "#94a3b8", "#a78bfa", "#34d399", "#7c3aed", "#f59e0b"]


@dataclass
class Listing:
    """One entry of suites.json."""

    folder: str  # relative to assets/bench; also the prefix of its download names
    adapter: str  # the SAT adapter it measured, e.g. "stage 4"
    note: str  # what it compares, in a few words
    question: str = ""  # current suites: the visitor's question it answers ("Code", "Chat", ...)
    readme: str = ""  # current suites: its row label in the README's results table


def listings(folder: Path = BENCH_DIR) -> tuple[list[Listing], list[Listing]]:
    """(current, history) as `folder`/suites.json lists them; both empty without the file."""
    path = folder / SUITES_FILE
    if not path.is_file():
        return [], []
    data = json.loads(path.read_text())
    return ([Listing(**entry) for entry in data.get("current", [])],
            [Listing(**entry) for entry in data.get("history", [])])


def _option(argv: list[str], flag: str) -> list[str] | None:
    """The values after `flag` in a command line (None when absent)."""
    if flag not in argv:
        return None
    values = []
    for word in argv[argv.index(flag) + 1:]:
        if word.startswith("--"):
            break
        values.append(word)
    return values


def _number(text: str) -> str:
    return f"{float(text):g}"


def described(summary: dict) -> tuple[str, str]:
    """(prompts, decoding) of a suite, read from its summary's command, source and prompt count, e.g.
    ("HumanEval 16–35", "sampled at T 0.7, top-p 0.95")."""
    argv = shlex.split(str(summary.get("command", "")))
    count = summary.get("prompts")
    files = _option(argv, "--prompts")
    if files:
        name = Path(files[0]).name
        prompts = f"{PROMPT_FILES.get(name, name)} ({count})" if count else PROMPT_FILES.get(name, name)
    else:
        subset = (_option(argv, "--subset") or [""])[0]
        first = int(subset.split("-")[0]) if re.fullmatch(r"\d+-\d+", subset) else 0
        prompts = ("HumanEval, all 164 problems" if count == 164 else
                   f"HumanEval {first}–{first + count - 1}" if isinstance(count, int) else "HumanEval")
    methods = _option(argv, "--methods")
    temperatures = _option(argv, "--temperatures")
    greedy = methods is None or bool(GREEDY_METHODS & set(methods))
    sampled = bool(temperatures) and (methods is None or any(m.endswith("_sample") for m in methods))
    parts = []
    if greedy:
        parts.append("greedy")
    if sampled:
        text = "sampled at T " + " and ".join(_number(t) for t in temperatures)
        for flag, name in (("--top-p", "top-p"), ("--top-k", "top-k")):
            value = _option(argv, flag)
            text += f", {name} {_number(value[0])}" if value else ""
        parts.append(text)
    decoding = " and ".join(parts) or "greedy"
    tokens = _option(argv, "--max-new-tokens")
    if tokens and tokens[0] != "128":
        decoding += f", {tokens[0]} new tokens"
    return prompts, decoding


def _commit(folder: Path) -> str:
    """The git commit results.json records (read from its head: the file can be large), or ""."""
    path = folder / "results.json"
    if not path.is_file():
        return ""
    with path.open(encoding="utf-8") as file:
        found = re.search(r'"git_commit":\s*"([0-9a-f]{7,40})"', file.read(4096))
    return found.group(1)[:7] if found else ""


@dataclass
class Suite:
    """One benchmark run: its table as HTML, its notes, and its files renamed for download."""

    key: str  # its folder under assets/bench, also the prefix of its download names
    title: str  # prompts, decoding (read from its files), the listing's note and adapter
    machine: str  # as summary.json records it, "" when it does not
    rows: list[dict]
    html: str  # the formatted table and the notes
    downloads: list[str] = field(default_factory=list)
    question: str = ""  # current suites: the question it answers; "" in the history
    date: str = ""  # when it ran, as summary.json records it
    readme: str = ""  # its row label in the README's results table, if any
    prompts: str = ""  # e.g. "HumanEval 16–35" (`described`)
    decoding: str = ""  # e.g. "sampled at T 0.7, top-p 0.95"


@dataclass
class BenchPage:
    """Everything the Benchmark tab shows, built once."""

    intro: str  # the sentence on where the numbers come from (markdown)
    figure: object | None  # the plotly chart of the current suites, None without results
    suites: list[Suite]  # the current suites, in the order of suites.json
    message: str = ""  # HTML shown instead of the chart when there are no results
    history: list[Suite] = field(default_factory=list)  # every other suite, newest first


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


def load_suite(folder: Path, listing: Listing, download_dir: Path | None = None) -> Suite | None:
    """The suite in `folder`, or None when it has no summary.json; an unreadable one says so."""
    path = folder / SUMMARY
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return Suite(listing.folder, listing.folder, "", [],
                     f'<div class="check bad">{esc(str(path.name))} is unreadable: {esc(str(err))}</div>')
    rows, notes = _rows_of(summary)
    notes = notes if isinstance(notes, dict) else {}
    machine = str(notes.get("machine", ""))
    prompts, decoding = described(notes)
    title = f"{prompts}, {decoding}" + (f": {listing.note}" if listing.note else "") + \
        (f" ({listing.adapter} adapter)" if listing.adapter else "")
    commit = _commit(folder)
    shown = {"adapter": listing.adapter} | notes | ({"commit": commit} if commit else {})
    parts = [table_html(rows)] if rows else ['<div class="check info">summary.json holds no rows.</div>']
    parts.append(f'<ul class="bench-notes">{"".join(_note(k, v) for k, v in shown.items() if v)}</ul>')
    suite = Suite(listing.folder, title, machine, rows, "".join(parts), question=listing.question,
                  date=str(notes.get("date", "")), readme=listing.readme, prompts=prompts, decoding=decoding)
    if download_dir is not None:
        download_dir.mkdir(parents=True, exist_ok=True)
        for file in sorted(folder.iterdir()):
            if file.is_file() and file.suffix in DOWNLOADS:
                target = download_dir / f"{listing.folder}-{file.name}"
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


def chart_method(method: str) -> str:
    """A row's method as the chart matches it: "sdsat_sample k=3 T=0.7 +tree" -> "sdsat k=3 +tree"."""
    method = re.sub(r" T=[0-9.]+", "", method)
    return re.sub(r"^sdsat_(greedy|sample)\b", "sdsat", method)


def _chart_row(rows: list[dict], method: str) -> dict | None:
    for row in rows:
        name = chart_method(str(row.get("method", "")))
        if name == method or name.startswith(method + " ("):
            return row
    return None


def baseline(rows: list[dict]) -> str:
    """What a suite's chart bars divide by: the fastest vanilla where it ran vanilla in every precision,
    else its vanilla, else (a sampled suite without greedy vanilla) vanilla sampling."""
    for column, name in ((FASTEST, "the fastest vanilla"), (SPEEDUP, "vanilla"), (VS_SAMPLING, "vanilla sampling")):
        if any(isinstance(r.get(column), (int, float)) for r in rows):
            return name
    return ""


def _speedup(row: dict, against: str):
    column = {"the fastest vanilla": FASTEST, "vanilla": SPEEDUP, "vanilla sampling": VS_SAMPLING}.get(against)
    value = row.get(column) if column else None
    if isinstance(value, (int, float)):
        return value
    # vanilla sampling against itself: the benchmark leaves the cell empty
    return 1.0 if against == "vanilla sampling" and str(row.get("method", "")).startswith("vanilla_sample") else None


def _label(suite: Suite) -> str:
    against = baseline(suite.rows)
    against = "" if against == "the fastest vanilla" else f" · ÷ {against}"
    prompts = suite.prompts.replace(" prompts", "")  # short lines: the labels share a phone's width with the bars
    return (f"{esc(prompts)}<br>{esc(suite.decoding.replace('sampled at ', ''))}"
            f"<br><sub>{esc(short_machine(suite.machine))}{esc(against)}</sub>")


def speedup_figure(suites: list[Suite]):
    """Horizontal grouped bars: the median speed-up against the fastest vanilla per suite (its prompts, decoding
    and machine under its name) and method. Horizontal, so that names and values stay readable at phone width.
    A suite that did not time the fastest vanilla says what its bars divide by instead."""
    import plotly.graph_objects as go

    figure = go.Figure()
    labels = [_label(s) for s in suites]
    for (method, name), colour in zip(CHART_METHODS.items(), CHART_COLOURS):
        suite_labels, values, hover = [], [], []
        for suite, label in zip(suites, labels):
            row = _chart_row(suite.rows, method)
            against = baseline(suite.rows)
            value = _speedup(row, against) if row is not None else None
            if value is None:
                continue
            suite_labels.append(label)
            values.append(value)
            rate = row.get("tokens/s")
            hover.append(f"{esc(suite.title)}<br>{esc(suite.machine or 'machine not recorded')}"
                         + (f"<br>{rate:.1f} tokens/s" if isinstance(rate, (int, float)) else "")
                         + f"<br>÷ {esc(against)}")
        if values:
            figure.add_bar(y=suite_labels, x=values, orientation="h", name=name, marker_color=colour,
                           text=[f"{v:.2f}×" for v in values], textposition="outside", cliponaxis=False,
                           hovertext=hover, hovertemplate="%{hovertext}<br>%{x:.2f}×<extra></extra>")
    top = max([v for trace in figure.data for v in trace.x] + [1.0])
    figure.add_vline(x=1.0, line_dash="dash", line_color="#475569")
    figure.update_layout(
        # The title sits on the plot, below the top strip where plotly's toolbar appears (over it on a phone).
        title=dict(text="Speed-up against the fastest vanilla", x=0.01, y=1, yref="paper", yanchor="bottom",
                   pad=dict(b=8), font=dict(size=15)),
        barmode="group", bargap=0.25, height=max(360, min(540, 120 + 55 * len(suites))), template="plotly_white",
        xaxis=dict(title="× the fastest vanilla tokens/s (median over prompts of each prompt's ratio)",
                   range=[0, 1.15 * top]),
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=labels),
        margin=dict(l=10, r=10, t=64, b=10),
        legend=dict(orientation="h", yanchor="top", y=-0.12, x=0, traceorder="normal"))
    return figure


def bench_page(folder: Path = BENCH_DIR, download_dir: Path | None = None) -> BenchPage:
    """The Benchmark tab, read from `folder` and its suites.json; result files are copied into `download_dir`
    under their folders' names."""
    download_dir = download_dir or Path(tempfile.mkdtemp(prefix="sdsat-bench-"))
    current, history = listings(folder)

    def load(entries: list[Listing]) -> list[Suite]:
        return [s for e in entries if (s := load_suite(folder / e.folder, e, download_dir / e.folder)) is not None]

    found, older = load(current), sorted(load(history), key=lambda s: s.date, reverse=True)
    machines = sorted({short_machine(s.machine) for s in found if s.machine})
    intro = ("These numbers were measured on "
             + (" and ".join(machines) if machines else "the machines each suite names")
             + " by the project's benchmark (`assets/bench/`, not recomputed here); a different CPU can give "
             "different speed-ups. Each bar is the median over prompts of one prompt's tokens/s ÷ the fastest "
             "plain decoding of that prompt on the same machine in the same run (any precision, any kernel form). "
             "The **Race** tab measures your own run, on the machine serving this page; its **This machine** "
             "panel shows what a forward pass costs there.")
    if not found:
        return BenchPage(intro, None, [], '<div class="check info">No benchmark results yet. They appear here once '
                                          "<code>assets/bench/suites.json</code> lists a folder written by "
                                          "<code>python -m sdsat.bench</code>.</div>", older)
    return BenchPage(intro, speedup_figure(found), found, history=older)


# -- the README's results table ---------------------------------------------------------------------------
README_START = "<!-- results table: `python -m sdsat.ui.benchmark --readme README.md` writes it from assets/bench/ -->"
README_END = "<!-- end of results table -->"
README_HEAD = ("| request | prompts | auto chose | tokens/s | × the fastest vanilla | × vanilla sampling "
               "| × prompt lookup | tokens per pass |\n|---|---|---|---:|---:|---:|---:|---:|")


def _times(value) -> str:
    return f"{value:.2f}×" if isinstance(value, (int, float)) else "not measured"


def _auto(suite: Suite | None) -> dict | None:
    return _chart_row(suite.rows, "sdsat auto") if suite is not None else None


def readme_row(suite: Suite | None, label: str) -> str:
    """One row of the README's table: the suite's auto row; a cell the suite did not measure says so."""
    auto = _auto(suite)
    if auto is None:
        return f"| {label} |" + " not measured |" * 7
    sampled = str(auto["method"]).startswith("sdsat_sample")
    choice = re.search(r"\((.*)\)", str(auto["method"]))
    precision = re.search(r", (?:cpu|cuda:\d+) (\w+)", suite.machine)
    chose = (choice.group(1) if choice else "?") + (f", {precision.group(1)}" if precision else "")
    cells = [f"**{label}**", suite.prompts, chose, f"{auto['tokens/s']:.1f}",
             f"**{_times(auto.get(FASTEST))}**",
             _times(auto.get(VS_SAMPLING)) if sampled else "–", _times(auto.get(VS_LOOKUP)),
             f"{auto['tokens / forward pass']:.2f}"]
    return "| " + " | ".join(cells) + " |"


def _machine_line(machine: str) -> str:
    """"AMD EPYC (flags: avx2, avx512_bf16), 2 cores, 2 torch threads, cpu bfloat16, torch 2.13.0+cpu" ->
    "AMD EPYC (avx2, avx512_bf16; no AMX), 2 cores, 2 torch threads, torch 2.13.0+cpu"."""
    machine = re.sub(r", (cpu|cuda:\d+) \w+", "", machine)
    return re.sub(r" \(flags: ([^)]*)\)", lambda m: f" ({m.group(1)}{'' if 'amx' in m.group(1) else '; no AMX'})",
                  machine)


def readme_table(folder: Path = BENCH_DIR) -> str:
    """The README's results table: for each current suite with a readme label, its auto row's tokens/s, speed-ups
    and tokens per pass, then one line naming the machine, the dates and the suites."""
    rows, machines, dates, links = [], [], [], []
    for listing in listings(folder)[0]:
        if not listing.readme:
            continue
        suite = load_suite(folder / listing.folder, listing)
        rows.append(readme_row(suite, listing.readme))
        if suite is None:
            continue
        for seen, value in ((machines, _machine_line(suite.machine)), (dates, suite.date[:10])):
            if value not in seen:
                seen.append(value)
        links.append(f"[{listing.readme.lower()}](assets/bench/{listing.folder}/)")
    foot = (f"Machine: {'; '.join(machines)}. The shipped SAT adapter, one interleaved run per row, 128 new tokens, "
            f"{', '.join(dates)}; each row's suite: {', '.join(links)}.")
    return "\n".join([README_START, README_HEAD, *rows, "", foot, README_END])


def main(argv: list[str] | None = None) -> int:
    """`python -m sdsat.ui.benchmark --readme [README.md]`: print the results table, or write it into the
    README between its markers."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "--readme":
        print("usage: python -m sdsat.ui.benchmark --readme [README.md]", file=sys.stderr)
        return 2
    table = readme_table()
    if len(args) == 1:
        print(table)
        return 0
    readme = Path(args[1])
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        print(f"error: {readme} has no results-table markers", file=sys.stderr)
        return 2
    before, rest = text.split(README_START, 1)
    readme.write_text(before + table + rest.split(README_END, 1)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
