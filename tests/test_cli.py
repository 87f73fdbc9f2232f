"""`python -m sdsat generate`, run as a user would: in a subprocess, on the embedded default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdsat.engine import DEFAULT_ADAPTER
from sdsat.sat import SatAdapter

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fib(n):"
# One torch thread: on a shared 2-core machine more threads make the model many times slower.
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sdsat", "generate", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


NEW_TOKENS = "24"
SEP = "\n" + "-" * 60 + "\n"  # between the text and the statistics


@pytest.fixture(scope="module")
def sdsat_json() -> dict:
    proc = cli("--prompt", PROMPT, "--method", "sdsat", "--k", "5", "--max-new-tokens", NEW_TOKENS, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # stdout is exactly one JSON object: nothing else got onto it


@pytest.fixture(scope="module")
def vanilla_output() -> str:
    """What `generate --method vanilla` prints for PROMPT: the reference of the SDSAT runs below."""
    proc = cli("--prompt", PROMPT, "--method", "vanilla", "--max-new-tokens", NEW_TOKENS)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_json_output_has_the_result_and_its_records(sdsat_json: dict):
    out = sdsat_json
    for key in ("token_ids", "text", "seconds", "tokens_per_second", "forward_passes", "steps", "stop_reason",
                "acceptance_by_position", "mean_tokens_per_iteration", "model", "settings"):
        assert key in out, key
    assert (out["method"], out["k"], out["settings"]["sampling"]["do_sample"]) == ("sdsat", 5, False)
    assert 0 < len(out["token_ids"]) <= int(NEW_TOKENS) and out["text"].strip()
    assert out["seconds"] > 0 and out["tokens_per_second"] > 0
    assert [t for step in out["steps"] for t in step["tokens"]] == out["token_ids"]
    # a verify pass per step, and a draft pass unless the step's drafts came from elsewhere (prompt lookup)
    assert out["forward_passes"] == sum(len(s["pass_seconds"]) for s in out["steps"])
    assert len(out["steps"]) < out["forward_passes"] <= 2 * len(out["steps"])
    assert all({"drafts", "accepted", "rejected", "sources", "kv_len"} <= set(step) for step in out["steps"])


def test_greedy_sdsat_prints_the_same_text_as_vanilla(sdsat_json: dict, vanilla_output: str):
    text, _, stats = vanilla_output.partition(SEP)
    assert text == sdsat_json["text"] + "\n"
    assert f"vanilla: {len(sdsat_json['token_ids'])} new tokens" in stats and "tokens/s" in stats


def test_lookup_verifies_copies_and_prints_the_same_text():
    prompt = "red, green, blue, red, green, blue, red, green, blue, red,"  # a pattern the model goes on with
    vanilla = cli("--prompt", prompt, "--method", "vanilla", "--max-new-tokens", "24")
    lookup = cli("--prompt", prompt, "--lookup", "8", "--max-new-tokens", "24")
    assert vanilla.returncode == lookup.returncode == 0, vanilla.stderr + lookup.stderr
    assert lookup.stdout.partition(SEP)[0] == vanilla.stdout.partition(SEP)[0]
    assert "prompt lookup: " in lookup.stdout and "iterations verified copied tokens" in lookup.stdout


def test_a_draft_tree_prints_the_same_text_and_how_often_a_runner_up_was_taken(vanilla_output: str):
    tree = cli("--prompt", PROMPT, "--tree", "2", "--k", "3", "--max-new-tokens", NEW_TOKENS)
    assert tree.returncode == 0, tree.stderr
    assert tree.stdout.partition(SEP)[0] == vanilla_output.partition(SEP)[0]
    assert "draft tree: up to 5 candidates per verify pass; " in tree.stdout  # k = 3 drafts and 2 runner-ups
    line = one_error_line(cli("--prompt", PROMPT, "--tree", "9"))
    assert "tree_candidates must be between 0 (off) and 8, got 9" in line


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr  # no traceback, no held-back warnings
    return lines[0]


def test_k_out_of_range_is_one_line_naming_k_and_the_range():
    line = one_error_line(cli("--prompt", PROMPT, "--k", "99"))
    max_k = SatAdapter.load(DEFAULT_ADAPTER).config.num_sats  # the shipped adapter's largest k
    assert f"k (number of adaptive tokens) must be between 1 and {max_k}, got 99" in line


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "prompt must be a non-empty string"),
    (["--prompt", PROMPT, "--temperature", "0"], "temperature must be in [0.01, 5.0], got 0.0"),
    # a tiny temperature overflows logits / T into NaN probabilities: refused, not a traceback
    (["--prompt", PROMPT, "--temperature", "1e-40"], "temperature must be in [0.01, 5.0], got 1e-40"),
    (["--prompt", PROMPT, "--temperature", "5e-324"], "temperature must be in [0.01, 5.0]"),
    (["--prompt", PROMPT, "--model", "/no/such/model"], "no such folder"),
])
def test_bad_settings_fail_before_loading_with_one_line(args: list[str], message: str):
    assert message in one_error_line(cli(*args))


def test_any_error_is_exit_2_with_one_line(capsys, monkeypatch):
    from sdsat import cli

    def broken(args, out):
        raise RuntimeError("the kernel said no\nat line 2")

    monkeypatch.setattr(cli, "_generate", broken)
    assert cli.main(["generate", "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err == "error: RuntimeError: the kernel said no at line 2\n"
