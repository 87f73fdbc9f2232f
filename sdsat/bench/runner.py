"""The benchmark loop: warm-up, then every variant on every prompt, interleaved prompt by prompt.

Interleaving puts all methods of a prompt next to each other in time, so a drift in the machine's
speed (another job starting, thermal throttling) hits them alike; the order of the variants is
rotated from one prompt to the next so none always runs first or last.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..cpu_kernels import installed_plan
from ..hardware import describe
from ..engine import Engine
from ..tuning import form_of
from .humaneval import check_completion
from .methods import GREEDY_METHODS, METHODS, Measurement, Variant, measure, run_label
from .prompts import BenchPrompt


@dataclass
class BenchConfig:
    """What to run on each prompt; the CLI fills this in."""

    methods: list[str] = field(default_factory=lambda: list(METHODS))  # which of METHODS to race
    k_list: list[int] | None = None  # sdsat_greedy's k sweep; None: 1..the SATs' max_k
    sample_k: int = 4  # sdsat_sample's k (capped at the SATs' max_k)
    temperatures: list[float] = field(default_factory=lambda: [0.2, 1.0])  # the paper's sampling temperatures
    top_p: float = 1.0  # nucleus for the sampling methods (1: off)
    top_k: int = 0  # the sampling methods keep this many likeliest tokens (0: off)
    seed: int = 0  # sampling seed of prompt i, repeat r: seed + 1000 * i + r (same for both samplers)
    max_new_tokens: int = 256  # per generation; EOS may end it sooner
    repeats: int = 1  # timed runs of each variant on each prompt
    warmup_tokens: int = 16  # each variant generates this many tokens once before timing; 0 skips
    lookup_tokens: int = 10  # prompt_lookup: prompt_lookup_num_tokens (drafts per step)
    lookup_ngram: int = 2  # prompt_lookup: max_matching_ngram_size
    tree_candidates: int = 2  # the tree recipes: runner-up candidates verified beside the k drafts

    def seed_for(self, prompt_index: int, repeat: int) -> int:
        return self.seed + 1000 * prompt_index + repeat


def encode_prompts(engine: Engine, prompts: list[BenchPrompt]) -> list[list[int]]:
    return [engine.encode(p.text, chat=p.kind == "chat") for p in prompts]


def fitting_prompts(prompts: list[BenchPrompt], prompt_ids: list[list[int]], variants: list[Variant],
                    config: BenchConfig,
                    max_context: int | None) -> tuple[list[BenchPrompt], list[list[int]], list[dict]]:
    """The prompts whose every run fits the model's context, renumbered from 0, and the skipped ones.

    A run needs the prompt, the new tokens and the positions its drafts reach past them; this counts
    the widest any variant can reach (fused SAT runs of 2k, a tree's runner-ups, prompt lookup's copies),
    so a prompt near the limit is skipped rather than failing mid-run.
    Returns (prompts, their ids, skipped: [{"name", "prompt_tokens", "needed", "max_context"}]).
    """
    if not isinstance(max_context, int) or max_context <= 0:
        return prompts, prompt_ids, []
    reach = 2 * max((v.k for v in variants), default=0) + config.tree_candidates + config.lookup_tokens
    planned = [v.auto.settings for v in variants if v.auto is not None]  # the auto recipe's own copies and tree
    reach = max([reach] + [2 * s.k + s.tree_candidates + s.lookup_tokens for s in planned])
    kept, kept_ids, skipped = [], [], []
    for prompt, ids in zip(prompts, prompt_ids):
        needed = len(ids) + config.max_new_tokens + reach
        if needed > max_context:
            skipped.append({"name": prompt.name, "prompt_tokens": len(ids), "needed": needed,
                            "max_context": max_context})
            continue
        prompt.index = len(kept)  # runs name prompts by position: keep it dense
        kept.append(prompt)
        kept_ids.append(ids)
    return kept, kept_ids, skipped


def engine_for(variant: Variant, engine: Engine, baselines: dict[str, Engine] | None) -> Engine:
    """The engine a variant runs on: its precision's baseline engine, else the main one."""
    if variant.precision is None:
        return engine
    if not baselines or variant.precision not in baselines:
        raise ValueError(f"no baseline engine in {variant.precision} for {variant.label}")
    return baselines[variant.precision]


def warm_up(engine: Engine, variants: list[Variant], prompt_ids: list[int], config: BenchConfig,
            baselines: dict[str, Engine] | None = None) -> Iterator[Variant]:
    """Run each variant once, untimed, so lazy initialisation and caches do not count; yields each one done.
    `baselines`: the engines of the other precisions vanilla runs in, by precision."""
    if config.warmup_tokens <= 0:
        return
    for variant in variants:
        measure(engine_for(variant, engine, baselines), variant, prompt_ids, config.warmup_tokens, seed=config.seed,
                top_p=config.top_p, top_k=config.top_k, lookup_ngram=config.lookup_ngram,
                lookup_tokens=config.lookup_tokens, tree_candidates=config.tree_candidates)
        yield variant


def measure_all(engine: Engine, variants: list[Variant], prompt_ids: list[list[int]], config: BenchConfig,
                baselines: dict[str, Engine] | None = None) -> Iterator[Measurement]:
    """Every variant on every prompt, `repeats` times; yields each measurement as it completes.
    A variant with a precision runs on that precision's engine in `baselines`, in the same rotation."""
    for index, ids in enumerate(prompt_ids):
        shift = index % len(variants)
        order = variants[shift:] + variants[:shift]
        for repeat in range(config.repeats):
            for variant in order:
                yield measure(engine_for(variant, engine, baselines), variant, ids, config.max_new_tokens,
                              seed=config.seed_for(index, repeat), top_p=config.top_p, top_k=config.top_k,
                              lookup_ngram=config.lookup_ngram, lookup_tokens=config.lookup_tokens,
                              tree_candidates=config.tree_candidates,
                              prompt_index=index, repeat=repeat)


def score_pass_at_1(prompts: list[BenchPrompt], runs: list[dict], timeout: float = 10.0) -> dict:
    """HumanEval pass@1 per variant from the first repeat of each prompt (one sample per problem).

    Returns {"by_variant": {label: {"passed", "total", "pass_at_1", ...}}, "results": [per run verdict],
    "greedy_equal": whether every greedy variant in the main engine's precision passed exactly the problems
    vanilla passed}.
    Identical completions are executed once.
    """
    problems = {p.index: p.problem for p in prompts if p.problem is not None}
    cache: dict[tuple[int, str], str] = {}
    by_variant: dict[str, dict] = {}
    results = []
    passed_sets: dict[str, set[int]] = {}
    for run in runs:
        problem = problems.get(run["prompt_index"])
        if problem is None or run["repeat"] != 0:
            continue
        key = (run["prompt_index"], run["text"])
        if key not in cache:
            cache[key] = check_completion(problem, run["text"], timeout=timeout).result
        verdict = cache[key]
        label = run_label(run)
        stats = by_variant.setdefault(label, {"passed": 0, "total": 0, "greedy": run["method"] in GREEDY_METHODS,
                                              "precision": run.get("precision")})
        stats["total"] += 1
        stats["passed"] += verdict == "passed"
        if verdict == "passed":
            passed_sets.setdefault(label, set()).add(run["prompt_index"])
        results.append({"prompt_index": run["prompt_index"], "label": label, "result": verdict})
    for stats in by_variant.values():
        stats["pass_at_1"] = stats["passed"] / stats["total"]
    # Vanilla in another precision may round to other tokens: its outputs need not match.
    greedy = [label for label, s in by_variant.items() if s["greedy"] and not s["precision"]]
    reference = passed_sets.get("vanilla", set())
    equal = all(passed_sets.get(label, set()) == reference for label in greedy)
    return {"by_variant": by_variant, "results": results, "greedy_equal": equal, "timeout_seconds": timeout}


def machine_info(engine: Engine) -> dict:
    """The hardware and software every figure depends on."""
    import transformers

    plan = installed_plan(engine.model)
    return describe(engine.model) | {
        "cpu_kernels": plan.summary() if plan is not None else "nn.Linear (not routed)",
        "form": form_of(engine.model),  # a tuning form: the kernels every method but baselines ran
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def baseline_info(baselines: dict[str, Engine]) -> dict:
    """Per precision of the baseline engines: its dtype, kernel form and CPU kernel plan."""
    info = {}
    for precision, engine in baselines.items():
        plan = installed_plan(engine.model)
        info[precision] = {"dtype": describe(engine.model)["dtype"], "form": form_of(engine.model),
                           "cpu_kernels": plan.summary() if plan is not None else "nn.Linear (not routed)"}
    return info


def git_commit() -> str | None:
    """The commit of the checkout the benchmark ran from, if it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
