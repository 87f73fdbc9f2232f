"""The benchmark: small real runs on the default model, asserting only what does not depend on the
machine's speed (fields, identical greedy outputs, forward-pass counts), plus the pass@1 harness,
Ctrl-C, and the performance check on the shipped adapter."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import measure_quickly

from sdsat.bench import __main__ as cli
from sdsat.bench.figures import build_figures, write_figures
from sdsat.bench.humaneval import check_completion, truncate_completion
from sdsat.bench.methods import GREEDY_METHODS, Variant, plan_variants
from sdsat.bench.prompts import PromptFileError, file_prompts, humaneval_prompts, parse_subset
from sdsat.bench.runner import BenchConfig, encode_prompts, measure_all
from sdsat.bench.stats import summarize

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_ADAPTER = ROOT / "assets" / "adapters" / "smollm2-135m-instruct"
CHAT_PROMPTS = ROOT / "assets" / "prompts" / "chat.jsonl"

# The performance check CI can afford: SDSAT greedy on the shipped adapter must emit at least this
# many tokens per forward pass (vanilla: 1.0; untrained SATs: 1.0). Set from the trained adapter's
# measured figure with a safety margin: 1.51 with the shipped adapter on the check's own prompts and
# settings (k=3, two_step, HumanEval 0-3, 48 tokens; the draft tree's comment below).
TOKENS_PER_FORWARD_PASS_FLOOR = 1.35
PERF_K = 3  # drafts per step in the performance check (and the tree's depth)
PERF_PROMPTS = "0-3"  # HumanEval problems, never trained on
PERF_TOKENS = 48

RUN_FIELDS = {"prompt_index", "repeat", "method", "k", "temperature", "seed", "new_tokens", "token_ids", "text",
              "seconds", "tokens_per_second", "forward_passes", "stop_reason", "tokens_per_iteration",
              "drafted_per_iteration", "accepted_per_iteration", "scheme", "passes_per_iteration",
              "kinds_per_iteration"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One small benchmark through the CLI: 2 HumanEval prompts, 8 tokens, every method."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["--limit", "2", "--max-new-tokens", "8", "--k", "1", "3", "--schemes", "two_step", "fused", "lookup",
            "lookup_tree", "--sample-k", "2",
            "--temperatures", "1.0", "--lookup-ngram", "1",  # one recurring token: copies within 8 tokens
            "--warmup-tokens", "2", "--baseline-precisions", "none", "--out-dir", str(out), "--no-png", "--quiet"]
    import io
    from contextlib import redirect_stdout

    import torch

    threads = torch.get_num_threads()  # --threads 1 keeps it fast on a busy machine; restored after
    stdout = io.StringIO()
    try:
        with redirect_stdout(stdout):
            code = cli.main(argv + ["--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return code, out, json.loads((out / "results.json").read_text()), stdout.getvalue()


def test_bench_writes_every_field(bench_run):
    code, out, payload, _ = bench_run
    assert code == 0
    assert payload["complete"] and not payload["interrupted"]
    meta = payload["meta"]
    for key in ("date", "command", "source", "model", "machine", "settings"):
        assert key in meta
    for key in ("cpu", "cores_available", "torch_threads", "torch", "transformers", "device", "dtype"):
        assert key in meta["machine"]
    assert meta["command"].startswith("python -m sdsat.bench --limit 2")
    labels = {"vanilla", "generate", "prompt_lookup k=10", "sdsat_greedy k=1", "sdsat_greedy k=3",
              "sdsat_greedy k=1 fused", "sdsat_greedy k=3 fused", "sdsat_greedy k=1 +lookup",
              "sdsat_greedy k=3 +lookup", "sdsat_greedy k=1 +lookup+tree", "sdsat_greedy k=3 +lookup+tree",
              "vanilla_sample T=1", "sdsat_sample k=2 T=1", "sdsat_sample k=2 T=1 fused",
              "sdsat_sample k=2 T=1 +lookup", "sdsat_sample k=2 T=1 +lookup+tree"}
    assert {row["label"] for row in payload["summary"]["variants"]} == labels
    assert len(payload["runs"]) == 2 * len(labels)
    for run in payload["runs"]:
        assert RUN_FIELDS <= set(run)
        assert run["new_tokens"] == len(run["token_ids"]) > 0
    for row in payload["summary"]["variants"]:
        for key in ("median_tokens_per_second", "median_speedup", "tokens_per_forward_pass", "acceptance_by_position"):
            assert key in row


def test_greedy_outputs_identical_to_vanilla(bench_run):
    _, _, payload, _ = bench_run
    runs = payload["runs"]
    vanilla = {r["prompt_index"]: r["token_ids"] for r in runs if r["method"] == "vanilla"}
    greedy = [r for r in runs if r["method"] in GREEDY_METHODS]
    assert len(greedy) == 2 * 11  # vanilla, generate, prompt lookup, sdsat k=1 and 3 in four schemes
    for run in greedy:
        assert run["token_ids"] == vanilla[run["prompt_index"]], run["method"]
    assert payload["summary"]["all_greedy_identical"]
    for row in payload["summary"]["variants"]:
        if row["method"] in GREEDY_METHODS:
            assert row["identical_to_vanilla"] == row["compared_to_vanilla"] == 2


def test_forward_passes_are_counted_honestly(bench_run):
    _, _, payload, _ = bench_run
    rows = {row["label"]: row for row in payload["summary"]["variants"]}
    assert rows["vanilla"]["tokens_per_forward_pass"] == 1.0
    assert rows["generate"]["tokens_per_forward_pass"] == 1.0  # the hook sees model.generate's passes too
    fused = copied = 0
    for run in payload["runs"]:
        if run["method"].startswith("sdsat"):
            iterations = len(run["tokens_per_iteration"])
            passes = run["passes_per_iteration"]
            assert run["forward_passes"] == sum(passes)  # the hook agrees with the decoder's own records
            if run["scheme"] == "fused":  # one draft pass, then one pass per iteration
                fused += 1
                assert passes == [2] + [1] * (iterations - 1)
                assert all(d == run["k"] for d in run["drafted_per_iteration"])
            else:  # two passes (draft, verify) per iteration, one where prompt lookup supplied the drafts at
                # once; prompt lookup's copies (1..10) may also stand in for the k drafts after a draft pass
                # (a tree shows the path it walked: up to k drafts)
                lookup, tree = "lookup" in run["scheme"], "tree" in run["scheme"]
                for n, drafted in zip(passes, run["drafted_per_iteration"]):
                    assert ((n, drafted) == (2, run["k"]) or (tree and n == 2 and 1 <= drafted <= run["k"])
                            or (lookup and n in (1, 2) and 1 <= drafted <= 10))
                copied += lookup and 1 in passes
            assert sum(run["tokens_per_iteration"]) == run["new_tokens"]
    assert fused > 0 and copied > 0


def test_pass_at_1_table_and_figures(bench_run):
    _, out, payload, stdout = bench_run
    p1 = payload["pass_at_1"]
    assert p1["greedy_equal"]
    assert p1["by_variant"]["vanilla"]["total"] == 2
    assert p1["by_variant"]["vanilla"]["passed"] == p1["by_variant"]["sdsat_greedy k=3"]["passed"]
    assert "| sdsat_greedy k=3 |" in stdout and "identical to vanilla" in stdout
    assert (out / "results.md").read_text() in stdout
    for name in ("speedup_vs_k", "tokens_per_second", "acceptance_by_position"):
        assert (out / f"{name}.html").stat().st_size > 1000
    from sdsat.bench.figures import tokens_per_second

    boxes = {trace.name: list(trace.y) for trace in tokens_per_second(payload).data}
    assert len(boxes) == len(payload["summary"]["variants"])
    assert all(len(values) == 2 for values in boxes.values()), boxes  # one run per prompt: schemes kept apart


@pytest.mark.skipif(importlib.util.find_spec("kaleido") is None or not shutil.which("chromium"),
                    reason="PNG export needs kaleido and Chromium (make browser installs it)")
def test_png_figures(bench_run, tmp_path):
    _, _, payload, _ = bench_run
    written, skipped = write_figures(build_figures(payload), tmp_path, png=True)
    assert skipped is None
    for name in ("speedup_vs_k", "tokens_per_second", "acceptance_by_position"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_harness_verdicts():
    problem = humaneval_prompts(subset="HumanEval/0")[0].problem
    assert check_completion(problem, problem["canonical_solution"]).result == "passed"
    wrong = check_completion(problem, "    return False\n")
    assert not wrong.passed and wrong.result.startswith("failed: AssertionError")
    start = time.monotonic()
    looping = check_completion(problem, "    while True:\n        pass\n", timeout=2)
    assert looping.result == "timed out" and time.monotonic() - start < 10
    assert check_completion(problem, problem["canonical_solution"] + "\ndef junk(:\n").passed  # cut at "\ndef"


def test_truncate_completion():
    assert truncate_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert truncate_completion("    return 1\n```\nMore text") == "    return 1"
    assert truncate_completion("    x = 1\n    return x\n") == "    x = 1\n    return x\n"


def test_ctrl_c_keeps_completed_runs(tmp_path):
    out = tmp_path / "interrupted"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "sdsat.bench", "--limit", "50", "--max-new-tokens", "4",
                             "--methods", "vanilla", "generate", "--warmup-tokens", "0", "--threads", "1",
                             "--baseline-precisions", "none",
                             "--out-dir", str(out),
                             "--quiet", "--no-figures"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            # a shell that starts jobs in the background ignores SIGINT for them; undo that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    results = out / "results.json"
    try:
        deadline = time.monotonic() + 240
        while not results.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, f"the benchmark ended early: {proc.stderr.read().decode()[-2000:]}"
        assert results.exists(), "no prompt finished in time"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # reads and closes the pipe
        code = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130, err.decode()[-2000:]
    payload = json.loads(results.read_text())
    assert payload["interrupted"] and not payload["complete"]
    assert len(payload["runs"]) >= 2
    assert len(payload["runs"]) < 100
    assert payload["summary"]["variants"]


def test_prompt_files(tmp_path):
    chat = file_prompts(CHAT_PROMPTS)
    assert len(chat) >= 10 and all(p.kind == "chat" for p in chat)
    assert [p.index for p in file_prompts(CHAT_PROMPTS, subset="2-3,0")] == [0, 1, 2]
    assert [p.name for p in file_prompts(CHAT_PROMPTS, limit=2)] == [chat[0].name, chat[1].name]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n\n{"prompt": "x", "kind": "poem"}\n')
    with pytest.raises(PromptFileError, match="line 3"):
        file_prompts(bad)
    bad.write_text("not json\n")
    with pytest.raises(PromptFileError, match="line 1"):
        file_prompts(bad)
    assert parse_subset("HumanEval/2,0-1", ["HumanEval/0", "HumanEval/1", "HumanEval/2"]) == [2, 0, 1]
    with pytest.raises(ValueError, match="out of range"):
        parse_subset("5", ["a"])


def test_plan_variants_rejects_bad_settings():
    variants = plan_variants(["sdsat_sample", "vanilla"], [1], 3, [0.2, 1.0], 10, max_k=8)
    assert variants == [Variant("vanilla"), Variant("sdsat_sample", 3, 0.2), Variant("sdsat_sample", 3, 1.0)]
    # Trees sample too: each recipe runs once per method.
    variants = plan_variants(["sdsat_greedy", "sdsat_sample"], [2], 3, [1.0], 10, max_k=8,
                             recipes=("tree", "two_step", "lookup_tree"))
    assert [(v.method, v.recipe) for v in variants] == [
        ("sdsat_greedy", "tree"), ("sdsat_greedy", "two_step"), ("sdsat_greedy", "lookup_tree"),
        ("sdsat_sample", "tree"), ("sdsat_sample", "two_step"), ("sdsat_sample", "lookup_tree")]
    with pytest.raises(ValueError, match="--tree-candidates must be between 1 and 8 for the tree recipes "
                                         r"\(--schemes tree, lookup_tree\), got 0"):
        plan_variants(["sdsat_greedy"], [2], 3, [1.0], 10, max_k=8, recipes=("lookup_tree",), tree_candidates=0)
    with pytest.raises(ValueError, match="unknown methods"):
        plan_variants(["medusa"], [1], 1, [1.0], 10, max_k=8)
    with pytest.raises(ValueError, match=r"--temperatures: temperature must be in \[0.01, 5.0\], got 6.0"):
        plan_variants(["sdsat_sample"], [1], 1, [1.0, 6.0], 10, max_k=8)
    with pytest.raises(ValueError, match="outside 1..8"):
        plan_variants(["sdsat_greedy"], [9], 1, [1.0], 10, max_k=8)


def _run(prompt, method, k, tokens, tps, drafted=None, accepted=None):
    return {"prompt_index": prompt, "repeat": 0, "method": method, "k": k, "temperature": None, "token_ids": tokens,
            "new_tokens": len(tokens), "tokens_per_second": tps, "seconds": len(tokens) / tps,
            "forward_passes": len(tokens),
            "tokens_per_iteration": [1] * len(drafted) if drafted is not None else None,
            "drafted_per_iteration": drafted, "accepted_per_iteration": accepted}


def test_summary_metrics_and_loud_mismatch():
    runs = [_run(0, "vanilla", 0, [1, 2, 3], 10.0), _run(1, "vanilla", 0, [4, 5], 20.0),
            _run(0, "sdsat_greedy", 2, [1, 2, 3], 30.0, drafted=[2, 2, 2], accepted=[2, 1, 0]),
            _run(1, "sdsat_greedy", 2, [4, 9], 10.0, drafted=[2], accepted=[0])]
    summary = summarize(runs)
    sdsat = next(r for r in summary["variants"] if r["method"] == "sdsat_greedy")
    assert sdsat["median_speedup"] == pytest.approx(1.75)  # median of 3.0 and 0.5
    # Overall: 5 tokens in 0.1 + 0.2 s against vanilla's 5 tokens in 0.3 + 0.1 s.
    assert sdsat["overall_speedup"] == pytest.approx((5 / 0.3) / (5 / 0.4))
    # Spec-Bench's ratio of mean tokens/s: (30 + 10) / 2 over (10 + 20) / 2; each of the three differs.
    assert sdsat["spec_bench_speedup"] == pytest.approx(40 / 30)
    assert sdsat["acceptance_by_position"] == pytest.approx([2 / 4, 1 / 4])
    assert sdsat["identical_to_vanilla"] == 1 and sdsat["compared_to_vanilla"] == 2
    assert summary["greedy_mismatches"] == [{"prompt_index": 1, "repeat": 0, "label": "sdsat_greedy k=2",
                                             "first_difference": 1}]
    assert not summary["all_greedy_identical"]


@pytest.mark.skipif(not (SHIPPED_ADAPTER / "adapter_config.json").is_file(),
                    reason="the shipped SAT adapter is not in assets/ yet")
def test_performance_floor_on_shipped_adapter(default_engine):
    """Not timed: SDSAT greedy with the shipped adapter must need clearly fewer forward passes per
    token than vanilla on HumanEval prompts, and produce vanilla's exact output."""
    assert default_engine.sat_trained
    prompts = humaneval_prompts(subset=PERF_PROMPTS)
    config = BenchConfig(max_new_tokens=PERF_TOKENS, warmup_tokens=0)
    k = min(PERF_K, default_engine.max_k)
    variants = [Variant("vanilla"), Variant("sdsat_greedy", k=k), Variant("sdsat_greedy", k=k, recipe="tree")]
    prompt_ids = encode_prompts(default_engine, prompts)
    runs = [m.to_dict() for m in measure_all(default_engine, variants, prompt_ids, config)]
    summary = summarize(runs)
    assert summary["all_greedy_identical"], summary["greedy_mismatches"]
    rows = {(r["k"], r["scheme"]): r for r in summary["variants"] if r["method"] == "sdsat_greedy"}
    assert rows[(k, "two_step")]["tokens_per_forward_pass"] >= TOKENS_PER_FORWARD_PASS_FLOOR, rows[(k, "two_step")]
    # The draft tree's runner-ups are accepted often enough to show (measured with the head's match term: draft 1
    # accepted 0.94 against 0.86, 1.94 against 1.90 tokens per forward pass, on these prompts; the term lifted the
    # chain from 1.86 and left the tree where it was).
    chain, tree = rows[(k, "two_step")], rows[(k, "tree")]
    assert tree["acceptance_by_position"][0] >= chain["acceptance_by_position"][0] + 0.05, (chain, tree)
    assert tree["tokens_per_forward_pass"] >= chain["tokens_per_forward_pass"] + 0.02, (chain, tree)


def test_pass_cost_measures_every_block_and_leaves_the_cache_as_it_was(monkeypatch):
    """The pass-cost probe times plain blocks of each size and draft blocks [t, SAT x k]."""
    import types

    from conftest import make_tiny_llama
    from sdsat.bench import pass_cost
    from sdsat.sat import AdapterConfig, SatAdapter, SatModel, SatSpec

    tiny_llama = make_tiny_llama()
    config = AdapterConfig(base_model="tiny", hidden_size=tiny_llama.config.hidden_size,
                           num_layers=tiny_llama.config.num_hidden_layers, num_sats=3, rank=2)
    sat_model = SatModel(tiny_llama, SatSpec(kind="adapter", max_k=3), SatAdapter.for_model(tiny_llama, config))
    lengths = []
    forward = sat_model.forward
    monkeypatch.setattr(sat_model, "forward", lambda ids, slots=None, cache=None, **kw: (
        lengths.append(cache.get_seq_length()), forward(ids, slots, cache=cache, **kw))[1])
    costs = pass_cost.measure(types.SimpleNamespace(model=tiny_llama, sat_model=sat_model), [1, 2, 4, 8], context=10,
                              repeats=2)
    assert set(costs["plain"]) == {1, 2, 4, 8} and set(costs["draft"]) == {1, 3}  # k <= max_k only
    assert all(s > 0 for table in costs.values() for s in table.values())
    assert lengths[0] == 0 and set(lengths[1:]) == {10}  # the prefill, then every pass from the same context
    assert "| plain causal | 8 |" in pass_cost.report(costs, 10) and "draft [t, SAT×3]" in pass_cost.report(costs, 10)
    # Two settings, interleaved: each gets its own table of sizes, and each was applied before its passes.
    applied = []
    both = pass_cost.measure_settings(types.SimpleNamespace(model=tiny_llama, sat_model=sat_model), [1, 2], context=10,
                                      repeats=2,
                                      settings={"a": lambda: applied.append("a"), "b": lambda: applied.append("b")})
    assert applied == ["a", "b"] * 3 and set(both) == {"a", "b"}
    assert all(set(both[n]["plain"]) == {1, 2} and set(both[n]["draft"]) == {1} for n in both)
    table = pass_cost.compare_report(both, 10)
    assert "a: relative" in table and "b: ms" in table and "| draft [t, SAT×1] | 2 |" in table


# -- issue 17: long prompts, Ctrl-C after the runs -----------------------------------------------------------
def small_bench(tmp_path, *extra: str) -> tuple[int, str]:
    """The benchmark in this process on the default model: 1 HumanEval prompt, 2 tokens, vanilla only."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import torch

    threads = torch.get_num_threads()
    err = io.StringIO()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            code = cli.main(["--limit", "1", "--max-new-tokens", "2", "--methods", "vanilla", "--warmup-tokens", "0",
                             "--threads", "1", "--baseline-precisions", "none", "--out-dir", str(tmp_path / "out"),
                             "--quiet", "--no-png", *extra])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the benchmark as a traceback")
    finally:
        torch.set_num_threads(threads)
    return code, err.getvalue()


def test_a_prompt_longer_than_the_context_is_skipped_with_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello " * 8300}) + "\n" + json.dumps({"prompt": "def add(a, b):"}) + "\n")
    code, err = small_bench(tmp_path, "--prompts", str(prompts), "--limit", "2", "--methods", "vanilla", "sdsat_greedy",
                            "--k", "2", "--no-figures")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "skipped" in line]
    assert lines == [lines[0]] and lines[0].startswith("skipped prompt line 1: 8301 tokens") and "8192" in lines[0]
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert ([p["name"] for p in payload["prompts"]] == ["line 2"]
            and payload["meta"]["skipped_prompts"][0]["name"] == "line 1")
    assert {r["prompt_index"] for r in payload["runs"]} == {0} and len(payload["runs"]) == 2


def test_top_k_reaches_both_samplers_and_a_bad_one_is_named(tmp_path):
    """--top-k 1 leaves one token to draw: vanilla and SDSAT sampling then give greedy's output, which the
    same seeded runs without it leave."""
    def sampled_runs(*top_k: str) -> tuple[list[int], list[dict], dict]:
        code, err = small_bench(tmp_path, "--max-new-tokens", "8", "--methods", "vanilla", "vanilla_sample",
                                "sdsat_sample", "--sample-k", "2", "--schemes", "two_step", "lookup_tree",
                                "--temperatures", "1.5", *top_k, "--no-figures", "--no-pass-at-1")
        assert code == 0, err
        payload = json.loads((tmp_path / "out" / "results.json").read_text())
        greedy = next(r["token_ids"] for r in payload["runs"] if r["method"] == "vanilla")
        return greedy, [r for r in payload["runs"] if r["method"] != "vanilla"], payload["meta"]["settings"]

    greedy, sampled, settings = sampled_runs("--top-k", "1")
    assert settings["top_k"] == 1 and len(sampled) == 3 and all(r["token_ids"] == greedy for r in sampled)
    greedy, sampled, settings = sampled_runs()
    assert settings["top_k"] == 0 and all(r["token_ids"] != greedy for r in sampled)
    code, err = small_bench(tmp_path, "--top-k", "5000")
    assert code == 2 and err.strip() == "error: --top-k: top_k must be between 0 (off) and 1000, got 5000"


def test_fitting_prompts_counts_the_widest_reach_of_any_variant():
    from sdsat.bench.prompts import BenchPrompt
    from sdsat.bench.runner import fitting_prompts

    prompts = [BenchPrompt(i, "x", "completion", f"p{i}") for i in range(3)]
    variants = plan_variants(["vanilla", "sdsat_greedy"], [2, 4], 2, [1.0], 10, 8, ("two_step", "fused"), 2)
    config = BenchConfig(methods=["vanilla", "sdsat_greedy"], k_list=[2, 4], max_new_tokens=10, lookup_tokens=10,
                         tree_candidates=2)
    reach = 2 * 4 + 2 + 10  # fused k=4 reaches 2k past the bonus; a tree adds its runner-ups, lookup its copies
    ids = [[1] * (100 - 10 - reach), [1] * (101 - 10 - reach), [1] * 5]
    kept, kept_ids, skipped = fitting_prompts(prompts, ids, variants, config, max_context=100)
    assert [p.name for p in kept] == ["p0", "p2"] and [p.index for p in kept] == [0, 1] and kept_ids == [ids[0], ids[2]]
    assert skipped == [{"name": "p1", "prompt_tokens": 101 - 10 - reach, "needed": 101, "max_context": 100}]


@pytest.mark.parametrize("stage", ["pass@1", "figures"])
def test_ctrl_c_after_the_runs_keeps_them_without_a_traceback(tmp_path, monkeypatch, stage):
    from sdsat.bench import figures, runner

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(*((runner, "score_pass_at_1", interrupt) if stage == "pass@1"
                          else (figures, "write_figures", interrupt)))
    code, err = small_bench(tmp_path)
    assert (code == 130 and "Traceback" not in err
            and err.strip().splitlines()[-1].startswith("interrupted: the 1 completed"))
    assert len(json.loads((tmp_path / "out" / "results.json").read_text())["runs"]) == 1


CTRL_C_DURING_A_PROGRAM = """
import signal, sys, threading, time
from pathlib import Path
from sdsat.bench.humaneval import run_program

# A child inherits an ignored or blocked SIGINT from its parent (pytest, after whatever ran in it): undo both.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
pid_file = Path(sys.argv[1])
program = f"import os, time\\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\\ntime.sleep(60)\\n"
main = threading.main_thread().ident

def ctrl_c_once_started():
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.02)
    signal.pthread_kill(main, signal.SIGINT)

threading.Thread(target=ctrl_c_once_started, daemon=True).start()
start = time.monotonic()
try:
    run_program(program, timeout=60)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.1f} s")
"""


def test_ctrl_c_during_a_humaneval_program_kills_it(tmp_path):
    # The program runs in its own process group, so the terminal's Ctrl-C never reaches it: left alone it
    # would run on, an orphan, after the benchmark has gone. (In a fresh interpreter: what earlier tests left
    # in this process, signal handlers included, must not decide it.)
    pid_file = tmp_path / "pid"
    done = subprocess.run([sys.executable, "-c", CTRL_C_DURING_A_PROGRAM, str(pid_file)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("interrupted after"), done.stdout + done.stderr
    assert float(done.stdout.split()[2]) < 30
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed and reaped, not left running


# -- issue 15: the auto recipe, the fastest vanilla as the baseline, the machine named ---------------------
def test_the_fastest_vanilla_of_any_precision_is_the_headline_baseline():
    """Per prompt, the fastest vanilla run of any precision divides; with none faster, vanilla itself does."""
    from sdsat.bench.stats import best_sdsat_greedy, headline_speedup

    def runs(bf16_tps: tuple[float, float]) -> list[dict]:
        bf16 = [_run(0, "vanilla", 0, [1, 7, 3], bf16_tps[0]), _run(1, "vanilla", 0, [4, 5], bf16_tps[1])]
        for run in bf16:  # rounds otherwise: another precision's output is not checked against vanilla's
            run["precision"] = "bfloat16"
        return [_run(0, "vanilla", 0, [1, 2, 3], 10.0), _run(1, "vanilla", 0, [4, 5], 20.0), *bf16,
                _run(0, "sdsat_greedy", 2, [1, 2, 3], 30.0, drafted=[2], accepted=[2]),
                _run(1, "sdsat_greedy", 2, [4, 5], 30.0, drafted=[2], accepted=[1])]

    faster = summarize(runs((15.0, 12.0)))  # bfloat16 is the faster vanilla on prompt 0 only
    rows = {r["label"]: r for r in faster["variants"]}
    sdsat = rows["sdsat_greedy k=2"]
    assert sdsat["median_speedup"] == pytest.approx((3.0 + 1.5) / 2)
    assert sdsat["median_speedup_vs_fastest_vanilla"] == pytest.approx((30 / 15 + 30 / 20) / 2)
    assert (sdsat["min_speedup_vs_fastest_vanilla"], sdsat["max_speedup_vs_fastest_vanilla"]) == pytest.approx((1.5, 2))
    # Overall: 5 tokens in 0.1 + 1/15 s over the fastest runs' 5 tokens in 0.2 + 0.1 s.
    assert sdsat["overall_speedup_vs_fastest_vanilla"] == pytest.approx((5 / (0.1 + 2 / 30)) / (5 / 0.3))
    assert headline_speedup(sdsat) == sdsat["median_speedup_vs_fastest_vanilla"]
    assert rows["vanilla"]["median_speedup_vs_fastest_vanilla"] == pytest.approx((10 / 15 + 1) / 2)
    assert faster["fastest_vanilla"]["counts"] == {"vanilla bfloat16": 1, "vanilla": 1}
    assert [w["label"] for w in faster["fastest_vanilla"]["by_prompt"]] == ["vanilla bfloat16", "vanilla"]
    assert rows["vanilla bfloat16"]["precision"] == "bfloat16"
    assert "identical_to_vanilla" not in rows["vanilla bfloat16"]
    assert faster["all_greedy_identical"]  # bfloat16 vanilla's other tokens are no mismatch
    assert best_sdsat_greedy(faster) is sdsat

    slower = summarize(runs((5.0, 10.0)))  # a slower precision never lowers the bar
    sdsat = next(r for r in slower["variants"] if r["label"] == "sdsat_greedy k=2")
    for name in ("median", "min", "max", "overall"):
        assert sdsat[f"{name}_speedup_vs_fastest_vanilla"] == pytest.approx(sdsat[f"{name}_speedup"])
    alone = summarize([r for r in runs((5.0, 10.0)) if not r.get("precision")])
    assert [r["median_speedup_vs_fastest_vanilla"] for r in alone["variants"]] == [
        r["median_speedup"] for r in alone["variants"]]


def test_auto_and_baseline_variants_are_named_by_what_they_run():
    from sdsat.bench.methods import AutoChoice, auto_choices, run_label
    from sdsat.planner import Settings
    from sdsat.tuning import Tuning

    greedy = AutoChoice(Settings("two_step", 3, 10, 8), {"settings": {}, "plan": {"reason": "r"}, "note": ""})
    sampled = AutoChoice(Settings("fused", 2, 0, 0), {"settings": {}, "plan": {"reason": "r"}, "note": ""})
    # --k and --sample-k do not apply to auto: a k outside the SATs' range is no error when only auto runs.
    variants = plan_variants(["sdsat_sample", "vanilla", "sdsat_greedy"], [9], 9, [1.0], 10, max_k=5,
                             recipes=("auto",), auto=(greedy, {1.0: sampled}), baselines=("bfloat16",))
    assert [v.label for v in variants] == ["vanilla", "vanilla bfloat16", "sdsat_greedy auto (k=3 +lookup+tree8)",
                                           "sdsat_sample T=1 auto (k=2 fused)"]
    assert variants[1].precision == "bfloat16" and variants[2].k == 3 and variants[3].auto is sampled
    with pytest.raises(ValueError, match="--schemes must be among two_step, fused, lookup, tree, lookup_tree, auto"):
        plan_variants(["sdsat_greedy"], [1], 1, [1.0], 10, max_k=5, recipes=("medusa",))
    # Without an acceptance trace there is no plan: the defaults run, and the runs say why.
    plain, plain_sampled = auto_choices(Tuning(note="no acceptance trace ships with these SATs"), max_k=2,
                                        temperatures=[0.7])
    assert plain.settings == plain_sampled[0.7].settings == Settings("two_step", 2, 0, 0)
    assert plain.record == {"settings": {"scheme": "two_step", "k": 2, "lookup_tokens": 0, "tree_candidates": 0},
                            "plan": None, "note": "no acceptance trace ships with these SATs"}
    run = {"method": "sdsat_greedy", "k": 2, "temperature": None, "scheme": "auto", "auto": plain.record}
    assert run_label(run) == "sdsat_greedy auto (no plan: k=2)"


def test_baseline_precisions_are_the_tuners_in_their_fastest_form_besides_the_main_engines(tiny_llama):
    import argparse
    import types

    from sdsat import attention, cpu_kernels
    from sdsat.costs import CostCurve
    from sdsat.tuning import INVARIANT, PER_ROW, ROUTED, Tuning

    engine = types.SimpleNamespace(model=tiny_llama, tuning=None)

    def chosen(*precisions, methods=("vanilla",)):
        args = argparse.Namespace(methods=list(methods), baseline_precisions=list(precisions))
        return cli.baseline_precisions(args, engine)

    # Without a tuning: another precision's engine takes the tuning kept for it (None: `_load_baselines`), and
    # float32 is the main engine's already, in the routed form a plain start loads.
    assert chosen("auto") == {"bfloat16": None}
    assert chosen("none") == {} and chosen("auto", methods=("sdsat_greedy",)) == {}
    assert chosen("float16", "float32", "float16") == {"float16": None}
    # A tuning that timed bfloat16's row-invariant one-token pass faster than its routed one.
    engine.tuning = Tuning(forms={"bfloat16": INVARIANT}, vanilla_s={"bfloat16 routed": 0.04},
                           curves={"bfloat16": CostCurve("bfloat16", {1: 0.03})})
    assert chosen("auto") == {"bfloat16": INVARIANT}
    engine.tuning.vanilla_s["bfloat16 routed"] = 0.02
    assert chosen("auto") == {"bfloat16": ROUTED}
    engine.tuning.vanilla_s["bfloat16 row-invariant per-row"] = 0.01  # the per-row attention's vanilla, faster
    assert chosen("auto") == {"bfloat16": PER_ROW}
    if cpu_kernels.invariant_available():  # the main engine left in the row-invariant form: float32 routed runs too
        cpu_kernels.install(tiny_llama, cpu_kernels.invariant_plan(tiny_llama))
        tiny_llama.set_attn_implementation(attention.register()[0])
        assert chosen("auto") == {"float32": ROUTED, "bfloat16": PER_ROW}
    with pytest.raises(SystemExit):
        cli.parse_args(["--baseline-precisions", "auto", "bfloat16"])


def test_a_baseline_the_main_tuning_did_not_time_takes_the_fastest_form_kept_for_its_precision(monkeypatch,
                                                                                                tiny_llama):
    """With --dtype float32 the main engine tunes float32 alone; vanilla in bfloat16 must still run in the form the
    tuning kept for bfloat16 timed fastest (not the routed form, which can be far slower), else the routed one."""
    import argparse
    import types

    from sdsat import engine as engine_module
    from sdsat import tuning as tuning_module
    from sdsat.costs import CostCurve
    from sdsat.tuning import COMPILED, PER_ROW, Tuning

    kept = {"tuning": Tuning(forms={"bfloat16": COMPILED}, curves={"bfloat16": CostCurve("bfloat16", {1: 0.05})},
                             vanilla_s={"bfloat16 routed": 0.07, "bfloat16 row-invariant per-row": 0.04})}
    loaded = types.SimpleNamespace(model=tiny_llama, sat_model=types.SimpleNamespace(model=tiny_llama),
                                   tune=lambda remeasure: kept["tuning"] if remeasure == "never" else None)
    monkeypatch.setattr(engine_module.Engine, "load", classmethod(lambda cls, *a, **kw: loaded))
    forms = []
    monkeypatch.setattr(tuning_module, "set_precision", lambda sat_model, precision, kernels, form: forms.append(
        (precision, form)))
    monkeypatch.setattr(tuning_module, "in_form", lambda sat_model, precision, kernels, form: False)
    args = argparse.Namespace(model=None, device="cpu", no_cpu_kernels=False, adapter=None)
    assert cli._load_baselines(args, {"bfloat16": None}) == {"bfloat16": loaded}
    assert forms == [("bfloat16", PER_ROW)]  # the fastest one-token pass of those kept for bfloat16
    kept["tuning"].vanilla_s["bfloat16 routed"] = 0.03
    forms.clear()
    cli._load_baselines(args, {"bfloat16": None})
    assert forms == []  # routed, as loaded: nothing to change
    kept["tuning"] = None  # nothing kept for this machine: the routed form a plain start loads
    cli._load_baselines(args, {"bfloat16": None})
    assert forms == []
    cli._load_baselines(args, {"bfloat16": COMPILED})  # a form the main tuning timed is taken as it is
    assert forms == [("bfloat16", COMPILED)]


def test_auto_recipe_decodes_with_the_plan_beside_vanilla_in_another_precision(tmp_path, monkeypatch):
    """`--schemes auto` decodes with the tuning's plan (greedy) and its plan for sampling at the run's
    temperature (sampled) and records both; vanilla in bfloat16 runs on an engine of its own, interleaved and
    labelled; results name the CPU."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import torch

    from sdsat import engine as engine_module
    from sdsat import tuning
    from sdsat.costs import measure_curve
    from sdsat.engine import Engine

    def fake_curve(sat_model, widths=(1, 2, 4, 8, 16), drafts=None, **kw):
        """Real passes (cheap ones) but fixed prices: float32 twice as fast as bfloat16, so the plan decodes in
        float32 whatever the machine's load, and bfloat16's vanilla needs an engine of its own."""
        curve = measure_curve(sat_model, widths=widths, drafts=drafts, context=32, repeats=1)
        scale = 0.01 if tuning.dtype_name(sat_model.model) == "float32" else 0.02
        curve.plain = {w: scale * (1 + 0.01 * w) for w in curve.plain}
        curve.draft = {k: scale * (1.1 + 0.01 * k) for k in curve.draft}
        curve.tree, curve.tree_k = {}, 0  # trees priced as plain blocks
        curve.spread, curve.fastest_one_s = 1.0, curve.plain[1]
        return curve

    measure_quickly(monkeypatch)  # a short row check; each form's one-token pass timed once: the fixed prices stand
    monkeypatch.setattr(tuning, "measure_curve", fake_curve)
    monkeypatch.setattr(engine_module, "cache_dir", lambda: tmp_path)  # these fake curves stay out of the cache
    calls = []
    stream = Engine.stream

    def spy(self, prompt_ids, config, should_stop=None):
        calls.append((id(self.model), tuning.dtype_name(self.model), config))
        return stream(self, prompt_ids, config, should_stop)

    monkeypatch.setattr(Engine, "stream", spy)
    monkeypatch.setattr(Engine, "warm_up", lambda self: None)  # the tuning's own decodes are not the run's
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            code = cli.main(["--limit", "2", "--max-new-tokens", "6", "--methods", "vanilla", "sdsat_greedy",
                             "sdsat_sample", "--schemes", "auto", "--temperatures", "1.0", "--baseline-precisions",
                             "bfloat16", "--warmup-tokens", "0", "--threads", "1", "--out-dir", str(out),
                             "--no-figures", "--no-pass-at-1", "--quiet"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    payload = json.loads((out / "results.json").read_text())
    meta, runs = payload["meta"], payload["runs"]
    plan = meta["tuning"]["plan"]
    assert plan is not None and meta["tuning"]["curves"]  # the whole tuning, once
    planned = (plan["settings"]["scheme"], plan["settings"]["k"], plan["settings"]["lookup_tokens"],
               plan["settings"]["tree_candidates"])
    greedy = [c for _, _, c in calls if c.method == "sdsat" and not c.sampling.do_sample]
    sampled = [c for _, _, c in calls if c.method == "sdsat" and c.sampling.do_sample]
    assert len(greedy) == len(sampled) == 2
    assert all((c.scheme, c.k, c.lookup_tokens, c.tree_candidates) == planned for c in greedy)
    auto_runs = {r["method"]: r for r in runs if r["scheme"] == "auto"}
    assert auto_runs["sdsat_greedy"]["auto"]["plan"] == plan and auto_runs["sdsat_greedy"]["k"] == planned[1]
    sample_settings = auto_runs["sdsat_sample"]["auto"]["settings"]
    assert "sampling at T=1" in auto_runs["sdsat_sample"]["auto"]["plan"]["reason"] and all(
        (c.scheme, c.k, c.lookup_tokens, c.tree_candidates) == tuple(sample_settings.values()) for c in sampled)
    # Vanilla in bfloat16: its own engine (another model object), interleaved prompt by prompt, labelled.
    main = {model for model, _, c in calls if c.method == "sdsat"}
    vanilla = {model for model, _, c in calls if c.method == "vanilla"}
    assert len(main) == 1 and len(vanilla) == 2 and main < vanilla
    assert {dtype for model, dtype, _ in calls if model not in main} == {"bfloat16"}
    assert meta["baselines"]["bfloat16"]["dtype"] == "bfloat16" and meta["settings"]["baseline_precisions"] == [
        "bfloat16"]
    order = [[(r["method"], r.get("precision")) for r in runs if r["prompt_index"] == p] for p in (0, 1)]
    assert len(order[0]) == 4 and order[1] == order[0][1:] + order[0][:1]  # the rotation moves it too
    assert ("vanilla", "bfloat16") in order[0]
    rows = {r["label"]: r for r in payload["summary"]["variants"]}
    assert "vanilla bfloat16" in rows and "vanilla" in rows
    assert rows["vanilla bfloat16"]["runs"] == 2 and payload["summary"]["all_greedy_identical"]
    assert any(label.startswith("sdsat_greedy auto (k=") for label in rows)
    table = (out / "results.md").read_text()
    machine = meta["machine"]
    assert "cpu_flags" in machine and f"{machine['cpu']} (flags: " in table.splitlines()[0]
    assert "speed-up vs fastest vanilla" in table and "- Fastest vanilla: " in table and "(the tuning's plan)" in table


def test_the_threads_table_divides_each_round_by_the_clis_same_round():
    """A slow spell that falls on one round moves both sides of that round's ratio: the table gives the median
    of per-round ratios (here 1.0 for vanilla), not the ratio of the places' medians (here 0.5)."""
    from sdsat.bench.threads import _table

    cli = [{"vanilla": v, "sdsat": 20.0} for v in (10.0, 30.0, 20.0)]
    http = [{"vanilla": v, "sdsat": 10.0, "race vanilla": v / 2, "race sdsat": 10.0} for v in (10.0, 30.0, 10.0)]
    lines = _table({"cli": cli, "http": http}).splitlines()
    row = next(line for line in lines if line.startswith("http"))
    assert row.split()[1:] == ["10.0", "(1.00×)", "10.0", "(0.50×)", "5.0", "(0.50×)", "10.0", "(0.50×)"]


def test_the_tuning_places_table_divides_each_round_by_the_first_places_same_round():
    """Each place's ratio to the first place is the median of per-round ratios, per form; a form one run
    lacks (a precision with no row-invariant form there) is left out rather than half-compared."""
    from sdsat.bench.tuning_places import _table

    cli = [{"bfloat16 keyed": s, "float32 routed": 0.040} for s in (0.040, 0.060, 0.050)]
    twin = [{"bfloat16 keyed": s, "float32 routed": 0.040} for s in (0.036, 0.060, 0.055)]
    cold = [{"bfloat16 keyed": s} for s in (0.044, 0.066, 0.050)]
    lines = _table({"cli": cli, "twin": twin, "cold": cold}).splitlines()
    assert "twin ÷ cli" in lines[0] and "cold ÷ cli" in lines[0]
    keyed = next(line for line in lines if line.startswith("bfloat16 keyed")).split()
    assert keyed[2:5] == ["50.0", "55.0", "50.0"]  # ms, the median of each place's rounds
    assert keyed[5:9] == ["1.00", "0.90", "1.00", "1.10"] and keyed[9:13] == ["1.10", "1.10", "1.10", "1.00"]
    assert not any(line.startswith("float32 routed") for line in lines)


def test_a_png_export_that_fails_once_is_tried_again_and_a_lasting_failure_is_one_line(tmp_path, monkeypatch):
    """kaleido's browser can be asked to render before its page's script has loaded on a busy machine."""
    import plotly.graph_objects as go

    from sdsat.bench import figures

    calls = []

    def flaky(fig, path, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise ValueError("Error 525: ReferenceError: kaleido_scopes is not defined")
        Path(path).write_bytes(b"\x89PNG")

    monkeypatch.setattr(go.Figure, "write_image", flaky)
    figures._write_png(go.Figure(), tmp_path / "a.png")
    assert len(calls) == 2 and (tmp_path / "a.png").exists()

    def broken(fig, path, **kwargs):
        raise ValueError("no browser\nmore")

    monkeypatch.setattr(go.Figure, "write_image", broken)
    with pytest.raises(figures.PngExportError, match=r"PNG export failed .*: no browser$"):
        figures._write_png(go.Figure(), tmp_path / "b.png")
