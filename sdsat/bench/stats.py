"""The summary of a benchmark: per method and setting, the metrics of SDSAT.md.

Works on run records as plain dicts (what `--json` holds), so the app can summarise a saved file
exactly as the CLI summarised the live run.

  tokens/s                 median over prompts of the prompt's median over repeats
  speed-up                 per prompt, tokens/s of the method / tokens/s of `vanilla`; median over prompts
                           (SDSAT rows also against prompt_lookup, and sdsat_sample against vanilla_sample)
  vs fastest vanilla       the same, and overall, against the fastest vanilla of any precision on each
                           prompt (vanilla also runs in other precisions on their own engines): the headline
  overall speed-up         all new tokens / all seconds, over vanilla's on the same prompts: the suite's
                           throughput, where long generations weigh more
  Spec-Bench speed-up      mean over prompts of tokens/s, over vanilla's mean on the same prompts (the
                           ratio Spec-Bench's evaluation/speed.py prints)
  tokens per forward pass  all new tokens / all forward passes (vanilla = 1.0)
  mean tokens / iteration  new tokens per iteration, the bonus token counted (vLLM's mean accepted length)
  acceptance by position   of the iterations that drafted position i, the share that accepted draft i
  identical to vanilla     greedy runs whose tokens equal vanilla's first run on the same prompt, in the
                           same numerics (the main engine's; vanilla in other precisions is not compared)
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from .methods import AUTO, GREEDY_METHODS, METHODS, run_label


MAIN_VANILLA = ("vanilla", 0, None, "two_step", None)  # vanilla on the main engine: the identity reference


def variant_key(run: dict) -> tuple:
    """(method, k, temperature, recipe, precision) of a JSON run record, which names the recipe "scheme";
    precision is None for runs on the main engine (every run before baseline precisions existed)."""
    return (run["method"], run["k"], run["temperature"], run.get("scheme", "two_step"), run.get("precision"))


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


def _against(group: list[dict], tps: dict[int, float], base_tps: dict[int, float], base_runs: list[dict]) -> dict:
    """A method's speed-ups over a baseline on the prompts both ran: the per-prompt ratio of tokens/s (median,
    min, max), the suite's throughput ratio (overall) and Spec-Bench's ratio of mean tokens/s."""
    ratios = _speedups(tps, base_tps)
    shared = set(tps) & set(base_tps)
    mine, base = _throughput(group, shared), _throughput(base_runs, shared)
    return {"median": statistics.median(ratios) if ratios else None, "min": min(ratios) if ratios else None,
            "max": max(ratios) if ratios else None, "overall": mine / base if mine and base else None,
            "spec_bench": _mean_ratio(tps, base_tps, shared)}


def fastest_vanilla(groups: dict[tuple, list[dict]]) -> tuple[dict[int, float], dict[int, tuple], list[dict]]:
    """Per prompt, the fastest vanilla of any precision (the main engine's wins ties).

    Returns (its tokens/s by prompt, its variant key by prompt, its runs on those prompts): the baseline of
    the speed-ups "vs fastest vanilla". With vanilla in one precision only, that is vanilla itself.
    """
    keys = sorted((key for key in groups if key[0] == "vanilla"), key=lambda key: key != MAIN_VANILLA)
    best_tps: dict[int, float] = {}
    best_key: dict[int, tuple] = {}
    for key in keys:
        for prompt, tps in _per_prompt_tps(groups[key]).items():
            if prompt not in best_tps or tps > best_tps[prompt]:
                best_tps[prompt], best_key[prompt] = tps, key
    runs = [r for prompt, key in best_key.items() for r in groups[key] if r["prompt_index"] == prompt]
    return best_tps, best_key, runs


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
    """Per-variant metrics (methods in METHODS order, then by recipe, k, temperature and precision), the
    fastest vanilla per prompt, and the greedy identity check."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(variant_key(run), []).append(run)
    vanilla_tps = _per_prompt_tps(groups.get(MAIN_VANILLA, []))
    fastest_tps, fastest_key, fastest_runs = fastest_vanilla(groups)
    lookup_tps = next((_per_prompt_tps(g) for key, g in groups.items() if key[0] == "prompt_lookup"), None)
    reference: dict[int, list[int]] = {}  # per prompt, the output of vanilla's first repeat
    for run in sorted(groups.get(MAIN_VANILLA, []), key=lambda r: r["repeat"]):
        reference.setdefault(run["prompt_index"], run["token_ids"])
    rows, mismatches = [], []
    order = sorted(groups, key=lambda key: (METHODS.index(key[0]), key[3] == AUTO, key[3], key[1], key[2] or 0.0,
                                            key[4] or ""))
    for key in order:
        group = groups[key]
        method, _, temperature, _, precision = key
        tps = _per_prompt_tps(group)
        row = _row(key, group, tps)
        plain = _against(group, tps, vanilla_tps, groups.get(MAIN_VANILLA, []))
        fastest = _against(group, tps, fastest_tps, fastest_runs)
        row.update({"median_speedup": plain["median"], "min_speedup": plain["min"], "max_speedup": plain["max"],
                    "overall_speedup": plain["overall"], "spec_bench_speedup": plain["spec_bench"],
                    "median_speedup_vs_fastest_vanilla": fastest["median"],
                    "min_speedup_vs_fastest_vanilla": fastest["min"], "max_speedup_vs_fastest_vanilla": fastest["max"],
                    "overall_speedup_vs_fastest_vanilla": fastest["overall"]})
        if method == "sdsat_greedy" and lookup_tps:
            ratios = _speedups(tps, lookup_tps)
            row["median_speedup_vs_prompt_lookup"] = statistics.median(ratios) if ratios else None
        if method == "sdsat_sample":
            base = _per_prompt_tps(groups.get(("vanilla_sample", 0, temperature, "two_step", None), []))
            ratios = _speedups(tps, base)
            row["median_speedup_vs_vanilla_sample"] = statistics.median(ratios) if ratios else None
        if method in GREEDY_METHODS and precision is None:  # another precision's vanilla may round otherwise
            mismatches.extend(_identity(row, group, reference))
        rows.append(row)
    winners = [{"prompt_index": p, "label": run_label(groups[fastest_key[p]][0]), "tokens_per_second": fastest_tps[p]}
               for p in sorted(fastest_key)]
    return {"variants": rows, "greedy_mismatches": mismatches, "all_greedy_identical": not mismatches,
            "fastest_vanilla": {"by_prompt": winners,
                                "counts": dict(Counter(w["label"] for w in winners).most_common())}}


def _row(key: tuple, group: list[dict], tps: dict[int, float]) -> dict:
    """A variant's metrics that need no baseline."""
    method, k, temperature, recipe, precision = key
    tokens = sum(r["new_tokens"] for r in group)
    passes = sum(r["forward_passes"] for r in group)
    stepped = [r for r in group if r["tokens_per_iteration"] is not None]  # engine runs: per-iteration records
    iterations = sum(len(r["tokens_per_iteration"]) for r in stepped)
    drafted, accepted = _acceptance(group)
    row = {
        "label": run_label(group[0]), "method": method, "k": k, "temperature": temperature, "scheme": recipe,
        "precision": precision,
        "runs": len(group), "prompts": len(tps), "new_tokens": tokens, "forward_passes": passes,
        "median_tokens_per_second": statistics.median(tps.values()),
        "tokens_per_forward_pass": tokens / passes if passes else None,
        "mean_tokens_per_iteration": sum(r["new_tokens"] for r in stepped) / iterations if iterations else None,
        "acceptance_by_position": [a / d for a, d in zip(accepted, drafted)],
        "drafted_by_position": drafted,
    }
    if group[0].get("auto"):
        row["auto"] = group[0]["auto"]
    return row


def _identity(row: dict, group: list[dict], reference: dict[int, list[int]]) -> list[dict]:
    """Count in `row` the runs whose tokens equal vanilla's on the same prompt; return the mismatches."""
    compared = [r for r in group if r["prompt_index"] in reference]
    bad = [r for r in compared if r["token_ids"] != reference[r["prompt_index"]]]
    row["identical_to_vanilla"] = len(compared) - len(bad)
    row["compared_to_vanilla"] = len(compared)
    return [{"prompt_index": r["prompt_index"], "repeat": r["repeat"], "label": row["label"],
             "first_difference": _first_difference(r["token_ids"], reference[r["prompt_index"]])} for r in bad]


def headline_speedup(row: dict) -> float | None:
    """The speed-up to quote: over the fastest vanilla of any precision (results before it: over vanilla)."""
    return row.get("median_speedup_vs_fastest_vanilla", row["median_speedup"])


def best_sdsat_greedy(summary: dict) -> dict | None:
    """The sdsat_greedy row with the highest median speed-up over the fastest vanilla (the setting to quote)."""
    rows = [r for r in summary["variants"] if r["method"] == "sdsat_greedy" and headline_speedup(r) is not None]
    return max(rows, key=headline_speedup, default=None)
