"""The Benchmark tab and the README's results table: what they read from assets/bench/, and that every suite
listed there exists and is labelled by its own files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sdsat.ui import benchmark

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "assets" / "bench"

# When each shipped adapter was in the tree (the benchmark runs of a stage began a few minutes before the
# commit that shipped it): a suite listed as measuring a stage must have run in that stage's window.
ADAPTER_SINCE = {"stage 1": "2026-11-30T06:00", "stage 2": "2026-12-01T21:00", "stage 3": "2026-12-02T00:30",
                 "stage 4": "2026-12-02T04:00", "stage 4 + head": "2026-12-04T04:00",
                 "stage 4 + head (2000 steps)": "2026-12-04T21:00", "stage 4 + head (MLP)": "2026-12-05T00:30",
                 "stage 4 + head (MLP, varied chat)": "2026-12-05T03:45",
                 "stage 4 + head (K 32, combiner)": "2026-12-05T12:10"}


def write_suite(folder: Path, rows: list[dict], **notes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(notes | {"rows": rows}))


def write_listing(folder: Path, current: list[dict], history: list[dict] = ()) -> None:
    (folder / "suites.json").write_text(json.dumps({"current": current, "history": list(history)}))


def bars_of(figure) -> dict[str, tuple[list, list]]:
    """Per chart method: (suite labels, values); horizontal bars, so y names the suite."""
    return {trace.name: (list(trace.y), list(trace.x)) for trace in figure.data}


def test_without_results_and_a_suite_with_escaping_notes_and_downloads(tmp_path):
    view = benchmark.bench_page(tmp_path, download_dir=tmp_path / "dl")
    assert "No benchmark results yet" in view.message and view.figure is None and view.suites == []
    write_suite(tmp_path / "he", [
        {"method": "vanilla", "tokens/s": 20.04, "speed-up vs vanilla (median)": 1.0, "pass@1": 0.0},
        {"method": "sdsat<script>", "tokens/s": 30.55, "speed-up vs vanilla (median)": 1.234567,
         "acceptance by draft position": [0.64, 0.4, 0.26, 0.33, 0.28, 0.25], "pass@1": 0.0}],
        machine="2 vCPU <b>, 2 cores, fp32", notes=["a < b", "c"], command="python -m sdsat.bench --subset 0-15",
        prompts=16, date="2026-12-02T04:09:56+00:00")
    (tmp_path / "he" / "results.md").write_text("| method |")
    (tmp_path / "he" / "results.json").write_text('{"meta": {"date": "x", "git_commit": "6f4c42c994ee27"}}')
    suite = benchmark.load_suite(tmp_path / "he", benchmark.Listing("he", "stage 4", "a note"), tmp_path / "dl")
    assert suite.title == "HumanEval 0–15, greedy: a note (stage 4 adapter)"
    assert "sdsat&lt;script&gt;" in suite.html and "<script>" not in suite.html
    assert "1.23×" in suite.html and "30.6" in suite.html and "0.64 · 0.40 · 0.26 · 0.33 · 0.28 …" in suite.html
    assert "[0.64" not in suite.html and "Left out, 0 or – in every row: pass@1" in suite.html  # no empty column
    assert "<li>a &lt; b</li>" in suite.html and "<code>python -m sdsat.bench --subset 0-15</code>" in suite.html
    assert "<b>adapter</b>: stage 4" in suite.html and "<b>commit</b>: 6f4c42c" in suite.html
    assert sorted(Path(p).name for p in suite.downloads) == ["he-results.json", "he-results.md", "he-summary.json"]
    assert benchmark.short_machine(suite.machine) == "2 vCPU <b>, 2 cores"


def test_the_chart_draws_greedy_sampled_and_gpu_suites_against_the_fastest_vanilla(tmp_path):
    """Greedy and sampled rows chart under one legend per method (auto's row is named after its choice, a
    sampled row carries its temperature), against the fastest vanilla; the history is folded, newest first."""
    epyc = "AMD EPYC (flags: avx2), 2 cores, 2 torch threads, cpu bfloat16, torch 2.13.0+cpu"
    fastest = "speed-up vs fastest vanilla (median)"
    write_suite(tmp_path / "code", [
        {"method": "prompt_lookup k=10", fastest: 1.31},
        {"method": "sdsat_greedy k=3", fastest: 1.11},
        {"method": "sdsat_greedy auto (k=3 +lookup)", fastest: 1.42}],
        machine=epyc, command="python -m sdsat.bench --subset 16-35", prompts=20)
    write_suite(tmp_path / "sampled", [
        {"method": "vanilla", fastest: 0.94},
        {"method": "vanilla_sample T=0.7", fastest: 0.9, "speed-up vs vanilla_sample (median)": "–"},
        {"method": "sdsat_sample k=3 T=0.7", fastest: 1.06, "speed-up vs vanilla_sample (median)": 1.17},
        {"method": "sdsat_sample T=0.7 auto (k=2 +lookup)", fastest: 1.33, "speed-up vs vanilla_sample (median)": 1.5}],
        machine=epyc, prompts=20, command="python -m sdsat.bench --subset 16-35 --methods vanilla vanilla_sample "
                                          "sdsat_sample --temperatures 0.7 --top-p 0.95")
    write_suite(tmp_path / "gpu", [
        {"method": "sdsat_greedy k=3 +lookup+tree", "speed-up vs vanilla (median)": 2.0, fastest: 1.6},
        {"method": "sdsat_greedy auto (k=2 +lookup+tree7)", "speed-up vs vanilla (median)": 2.5, fastest: 2.5}],
        machine="Intel(R) Xeon(R) Processor (flags: avx2, amx_tile), 16 cores, 16 torch threads, cuda:0 float32, "
                "torch 2.11.0", command="python -m sdsat.bench --device cuda --subset 0-7", prompts=8)
    write_suite(tmp_path / "old", [{"method": "sdsat_greedy k=3", "speed-up vs vanilla (median)": 1.3}],
                machine=epyc, command="python -m sdsat.bench --limit 16", prompts=16, date="2026-11-30")
    write_suite(tmp_path / "older", [{"method": "sdsat_greedy k=3", "speed-up vs vanilla (median)": 1.2}],
                machine=epyc, command="python -m sdsat.bench --limit 16", prompts=16, date="2026-11-29")
    write_listing(tmp_path, [{"folder": f, "adapter": "stage 4", "note": "", "question": q}
                             for f, q in (("code", "Code"), ("sampled", "Sampling"), ("gpu", "On a GPU"))],
                  [{"folder": "older", "adapter": "stage 1", "note": ""}, {"folder": "old", "adapter": "stage 1",
                                                                          "note": ""}])
    view = benchmark.bench_page(tmp_path, download_dir=tmp_path / "dl")
    assert [s.key for s in view.suites] == ["code", "sampled", "gpu"]
    assert [s.key for s in view.history] == ["old", "older"]  # newest first
    assert "AMD EPYC, 2 cores and GPU (cuda:0 float32)" in view.intro
    assert "Race** tab measures your own run" in view.intro
    bars = bars_of(view.figure)
    auto = bars[benchmark.CHART_METHODS["sdsat auto"]]
    assert auto[1] == [1.42, 1.33, 2.5]
    assert "HumanEval 16–35<br>greedy" in auto[0][0] and "T 0.7, top-p 0.95" in auto[0][1] and "cuda:0" in auto[0][2]
    assert bars[benchmark.CHART_METHODS["vanilla_sample"]][1] == [0.9]
    assert bars[benchmark.CHART_METHODS["sdsat k=3"]][1] == [1.11, 1.06]
    assert bars[benchmark.CHART_METHODS["prompt_lookup k=10"]][1] == [1.31]
    assert bars[benchmark.CHART_METHODS["sdsat k=3 +lookup+tree"]][1] == [1.6]
    assert view.suites[2].title.startswith("HumanEval 0–7, greedy")


def test_a_sampled_suite_without_greedy_vanilla_is_charted_against_vanilla_sampling(tmp_path):
    write_suite(tmp_path / "s", [
        {"method": "vanilla_sample T=1", "speed-up vs vanilla (median)": "–",
         "speed-up vs vanilla_sample (median)": "–"},
        {"method": "sdsat_sample T=1 auto (k=1 +lookup)", "speed-up vs vanilla (median)": "–",
         "speed-up vs vanilla_sample (median)": 1.1}],
        machine="AMD EPYC, 2 cores", prompts=8,
        command="python -m sdsat.bench --methods vanilla_sample sdsat_sample --temperatures 1.0 "
                "--prompts assets/prompts/heldout_chat.jsonl")
    write_listing(tmp_path, [{"folder": "s", "adapter": "stage 4", "note": "", "question": "Chat"}])
    view = benchmark.bench_page(tmp_path, download_dir=tmp_path / "dl")
    assert view.suites[0].title == "held-out chat prompts (8), sampled at T 1 (stage 4 adapter)"
    bars = bars_of(view.figure)
    labels, values = bars[benchmark.CHART_METHODS["sdsat auto"]]
    assert values == [1.1] and "÷ vanilla sampling" in labels[0]
    assert bars[benchmark.CHART_METHODS["vanilla_sample"]][1] == [1.0]


@pytest.mark.parametrize("command, prompts, expected", [
    ("python -m sdsat.bench --subset 16-35 --k 3", 20, ("HumanEval 16–35", "greedy")),
    ("python -m sdsat.bench --subset 16-35 --limit 10 --methods vanilla vanilla_sample sdsat_sample "
     "--temperatures 0.7 --top-p 0.95", 10, ("HumanEval 16–25", "sampled at T 0.7, top-p 0.95")),
    ("python -m sdsat.bench --limit 16 --max-new-tokens 256", 16, ("HumanEval 0–15", "greedy, 256 new tokens")),
    ("python -m sdsat.bench --limit 16 --temperatures 1.0 --sample-k 3", 16, ("HumanEval 0–15",
                                                                               "greedy and sampled at T 1")),
    ("python -m sdsat.bench --subset 0-163", 164, ("HumanEval, all 164 problems", "greedy")),
    ("python -m sdsat.bench --prompts assets/prompts/chat.jsonl --limit 6", 6, ("chat prompts (6)", "greedy")),
])
def test_described_reads_prompts_and_decoding_from_the_command(command, prompts, expected):
    assert benchmark.described({"command": command, "prompts": prompts}) == expected


# -- the suites shipped in assets/bench -------------------------------------------------------------------
def test_every_suite_folder_is_listed_once_and_every_listed_suite_exists():
    current, history = benchmark.listings(BENCH)
    listed = [entry.folder for entry in current + history]
    on_disk = sorted(p.parent.relative_to(BENCH).as_posix() for p in BENCH.glob("**/summary.json"))
    assert len(listed) == len(set(listed)), "a folder is listed twice"
    assert sorted(listed) == on_disk
    assert all(entry.question for entry in current) and not any(entry.question or entry.readme for entry in history)
    view = benchmark.bench_page(BENCH, download_dir=None)
    assert [s.key for s in view.suites] == [e.folder for e in current]  # each loads, in the listed order
    assert len(view.history) == len(history) and view.figure is not None


def _expected_words(folder: str) -> list[str]:
    """What a suite's title must say, read from its folder's name."""
    words = []
    for part, word in (("humaneval-16-35", "HumanEval 16–35"), ("humaneval-0-15", "HumanEval 0–15"),
                       ("humaneval-16-25", "HumanEval 16–25"), ("humaneval-164", "all 164"),
                       ("heldout-chat", "held-out chat prompts"), ("heldout-code", "held-out code prompts"),
                       ("sampling-chat", "held-out chat prompts"), ("-t07", "T 0.7"), ("-t1", "T 1"),
                       ("he16-35", "HumanEval 16–35")):
        if part in folder:
            words.append(word)
    if re.fullmatch(r"(stage\d-)?chat(-16)?", folder):
        words.append("chat prompts")
    return words


def test_each_title_belongs_to_its_own_folder():
    """Titles are read from each folder's own files; here they are checked against the folder's name, the
    machine (a GPU suite's precision), the adapter's dates and the README's row labels."""
    current, history = benchmark.listings(BENCH)
    for entry in current + history:
        suite = benchmark.load_suite(BENCH / entry.folder, entry)
        for word in _expected_words(entry.folder):
            assert word in suite.title, (entry.folder, suite.title)
        if entry.folder.startswith("gpu-"):
            assert f"cuda:0 {entry.folder.rsplit('-', 1)[1]}" in suite.machine, entry.folder
        if not any(f"-{t}" in entry.folder for t in ("t07", "t1")) and "sampling" not in entry.folder:
            assert "sampled" not in suite.title or "greedy" in suite.title, (entry.folder, suite.title)
        stages = sorted(ADAPTER_SINCE.items(), key=lambda item: item[1])
        since = ADAPTER_SINCE[entry.adapter]
        until = next((start for _, start in stages if start > since), "9999")
        assert since <= suite.date < until, (entry.folder, entry.adapter, suite.date)
        if entry.readme:
            label_temperature = re.search(r"T ([0-9.]+)", entry.readme)
            assert ("sampled at T " + label_temperature.group(1) in suite.title if label_temperature
                    else "greedy" in suite.title), (entry.readme, suite.title)
            kind = entry.readme.split(",")[0]
            assert (kind == "Code" and ("HumanEval" in suite.prompts or "code" in suite.prompts)
                    or kind == "Chat" and "chat" in suite.prompts), (entry.readme, suite.prompts)


def test_the_readme_table_is_written_from_the_current_suites():
    readme = (ROOT / "README.md").read_text()
    table = benchmark.readme_table(BENCH)
    assert table in readme, "README's results table is stale: python -m sdsat.ui.benchmark --readme README.md"
    assert "not measured" in table  # transformers' prompt lookup is greedy only: no sampled comparison exists
    for row in table.splitlines()[3:-3]:
        assert row.count("|") == 9 and re.search(r"\*\*\d\.\d\d×\*\*", row), row
