"""The summary of a benchmark: per method and setting, the metrics of SDSAT.md.

Works on run records as plain dicts (what `--json` holds), so the app can summarise a saved file
exactly as the CLI summarised the live run.

  tokens/s                 median over prompts of the prompt's median over repeats
  speed-up                 per prompt, tokens/s of the method / tokens/s of `vanilla`; median over prompts
                           (SDSAT rows also against prompt_lookup, and sdsat_sample against vanilla_sample)
  overall speed-up         all new tokens / all seconds, over vanilla's on the same prompts: the suite's
                           throughput, where long generations weigh more
  Spec-Bench speed-up      mean over prompts of tokens/s, over vanilla's mean on the same prompts (the
                           ratio Spec-Bench's evaluation/speed.py prints)
  tokens per forward pass  all new tokens / all forward passes (vanilla = 1.0)
  mean tokens / iteration  new tokens per iteration, the bonus token counted (vLLM's mean accepted length)
  acceptance by position   of the iterations that drafted position i, the share that accepted draft i
  identical to vanilla     greedy runs whose tokens equal vanilla's first run on the same prompt
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .methods import GREEDY_METHODS, METHODS, label_of


def variant_key(run: dict) -> tuple:
    """(method, k, temperature, recipe) of a JSON run record, which names the recipe "scheme"."""
    return (run["method"], run["k"], run["temperature"], run.get("scheme", "two_step"))


def _per_prompt_tps(runs: list[dict]) -> dict[int, float]:
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        by_prompt[run["prompt_index"]].append(run["tokens_per_second"])
    return {p: statistics.median(v) for p, v in by_prompt.items()}


def _speedups(tps: dict[int, float], base: dict[int, float]) -> list[float]:
    return [tps[p] / base[p] for p in sorted(tps) if p in base and base[p] > 0]


def _throughput(runs: list[dict], prompts: set[int]) -> float | None:
    picked = [r for r in runs if r["prompt_index"] in prompts]
    seconds = sum(r["seconds"] for r in picked)
    return sum(r["new_tokens"] for r in picked) / seconds if seconds > 0 else None


def _mean_ratio(tps: dict[int, float], base: dict[int, float], prompts: set[int]) -> float | None:
    base_mean = statistics.fmean(base[p] for p in prompts) if prompts else 0.0
    return statistics.fmean(tps[p] for p in prompts) / base_mean if base_mean > 0 else None


def _acceptance(runs: list[dict]) -> tuple[list[int], list[int]]:
    drafted: list[int] = []
    accepted: list[int] = []
    for run in runs:
        for d, a in zip(run["drafted_per_iteration"] or [], run["accepted_per_iteration"] or []):
            while len(drafted) < d:
                drafted.append(0)
                accepted.append(0)
            for i in range(d):
                drafted[i] += 1
                accepted[i] += i < a
    return drafted, accepted


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def summarize(runs: list[dict]) -> dict:
    """Per-variant metrics (methods in METHODS order, then by k and temperature) and the greedy identity check."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(variant_key(run), []).append(run)
    vanilla_key = ("vanilla", 0, None, "two_step")
    vanilla_tps = _per_prompt_tps(groups.get(vanilla_key, []))
    lookup_tps = next((_per_prompt_tps(g) for key, g in groups.items() if key[0] == "prompt_lookup"), None)
    reference: dict[int, list[int]] = {}  # per prompt, the output of vanilla's first repeat
    for run in sorted(groups.get(vanilla_key, []), key=lambda r: r["repeat"]):
        reference.setdefault(run["prompt_index"], run["token_ids"])
    rows, mismatches = [], []
    order = sorted(groups, key=lambda key: (METHODS.index(key[0]), key[3], key[1], key[2] or 0.0))
    for method, k, temperature, recipe in order:
        group = groups[(method, k, temperature, recipe)]
        tps = _per_prompt_tps(group)
        speedups = _speedups(tps, vanilla_tps)
        tokens = sum(r["new_tokens"] for r in group)
        passes = sum(r["forward_passes"] for r in group)
        stepped = [r for r in group if r["tokens_per_iteration"] is not None]  # engine runs: per-iteration records
        iterations = sum(len(r["tokens_per_iteration"]) for r in stepped)
        drafted, accepted = _acceptance(group)
        shared = set(tps) & set(vanilla_tps)
        mine, base = _throughput(group, shared), _throughput(groups.get(vanilla_key, []), shared)
        row = {
            "label": label_of(method, k, temperature, recipe), "method": method, "k": k, "temperature": temperature,
            "scheme": recipe,
            "runs": len(group), "prompts": len(tps), "new_tokens": tokens, "forward_passes": passes,
            "median_tokens_per_second": statistics.median(tps.values()),
            "median_speedup": statistics.median(speedups) if speedups else None,
            "min_speedup": min(speedups) if speedups else None,
            "max_speedup": max(speedups) if speedups else None,
            "overall_speedup": mine / base if mine and base else None,
            "spec_bench_speedup": _mean_ratio(tps, vanilla_tps, shared),
            "tokens_per_forward_pass": tokens / passes if passes else None,
            "mean_tokens_per_iteration": sum(r["new_tokens"] for r in stepped) / iterations if iterations else None,
            "acceptance_by_position": [a / d for a, d in zip(accepted, drafted)],
            "drafted_by_position": drafted,
        }
        if method == "sdsat_greedy" and lookup_tps:
            ratios = _speedups(tps, lookup_tps)
            row["median_speedup_vs_prompt_lookup"] = statistics.median(ratios) if ratios else None
        if method == "sdsat_sample":
            base = _per_prompt_tps(groups.get(("vanilla_sample", 0, temperature, "two_step"), []))
            ratios = _speedups(tps, base)
            row["median_speedup_vs_vanilla_sample"] = statistics.median(ratios) if ratios else None
        if method in GREEDY_METHODS:
            compared = [r for r in group if r["prompt_index"] in reference]
            bad = [r for r in compared if r["token_ids"] != reference[r["prompt_index"]]]
            row["identical_to_vanilla"] = len(compared) - len(bad)
            row["compared_to_vanilla"] = len(compared)
            mismatches.extend({"prompt_index": r["prompt_index"], "repeat": r["repeat"], "label": row["label"],
                               "first_difference": _first_difference(r["token_ids"], reference[r["prompt_index"]])}
                              for r in bad)
        rows.append(row)
    return {"variants": rows, "greedy_mismatches": mismatches, "all_greedy_identical": not mismatches}


def best_sdsat_greedy(summary: dict) -> dict | None:
    """The sdsat_greedy row with the highest median speed-up (the k to quote)."""
    rows = [r for r in summary["variants"] if r["method"] == "sdsat_greedy" and r["median_speedup"] is not None]
    return max(rows, key=lambda r: r["median_speedup"], default=None)
