"""The results as a markdown table, with the machine and settings they were measured under."""

from __future__ import annotations

from .stats import best_sdsat_greedy


def _num(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _load(values) -> str:
    return "–" if not values else f"{values[0]:.1f}"  # the 1-minute figure


def _acceptance(row: dict, positions: int = 4) -> str:
    acc = row["acceptance_by_position"][:positions]
    return (" ".join(f"{a:.2f}" for a in acc) + (" …" if len(row["acceptance_by_position"]) > positions else "")
            if acc else "–")


def markdown_table(payload: dict) -> str:
    """The summary table of a results payload (as written by `--json`), with a header and notes."""
    meta, summary = payload["meta"], payload["summary"]
    machine, settings = meta["machine"], meta["settings"]
    pass_at_1 = (payload.get("pass_at_1") or {}).get("by_variant", {})
    lines = [
        f"**{meta['source']}**, {len(payload['prompts'])} prompts, up to {settings['max_new_tokens']} new tokens, "
        f"{settings['repeats']} repeat(s); model `{meta['model']['name']}` ({machine['dtype']}, {machine['device']}); "
        f"{machine['cpu']}, {machine['cores_available']} cores, {machine['torch_threads']} torch threads; "
        f"torch {machine['torch']}, transformers {machine['transformers']}; load average "
        f"{_load(machine.get('load_average_at_start'))} at start, {_load(machine.get('load_average_at_end'))} at end; "
        f"{meta['date']}.",
        "",
        "| method | tokens/s (median) | speed-up vs vanilla (median, min–max; overall; Spec-Bench) "
        "| tokens / forward pass "
        "| mean tokens / iteration (bonus counted) | acceptance by draft position 1.. "
        "| identical to vanilla | HumanEval pass@1 |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in summary["variants"]:
        speedup = "–" if row["median_speedup"] is None else (
            f"{row['median_speedup']:.2f}× ({row['min_speedup']:.2f}–{row['max_speedup']:.2f}"
            + (f"; overall {row['overall_speedup']:.2f}×" if row.get("overall_speedup") else "")
            + (f"; Spec-Bench {row['spec_bench_speedup']:.2f}×)" if row.get("spec_bench_speedup") else ")"))
        if row.get("median_speedup_vs_prompt_lookup") is not None:
            speedup += f"; {row['median_speedup_vs_prompt_lookup']:.2f}× vs prompt_lookup"
        if "median_speedup_vs_vanilla_sample" in row and row["median_speedup_vs_vanilla_sample"] is not None:
            speedup += f"; {row['median_speedup_vs_vanilla_sample']:.2f}× vs vanilla_sample"
        identical = (f"{row['identical_to_vanilla']}/{row['compared_to_vanilla']}"
                     if "identical_to_vanilla" in row else "n/a (sampled)")
        if "identical_to_vanilla" in row and row["identical_to_vanilla"] != row["compared_to_vanilla"]:
            identical = f"**{identical} MISMATCH**"
        p1 = pass_at_1.get(row["label"])
        passed = "–" if p1 is None else f"{p1['pass_at_1']:.3f} ({p1['passed']}/{p1['total']})"
        lines.append(
            f"| {row['label']} | {_num(row['median_tokens_per_second'], '.1f')} | {speedup} "
            f"| {_num(row['tokens_per_forward_pass'])} | {_num(row['mean_tokens_per_iteration'])} "
            f"| {_acceptance(row)} | {identical} | {passed} |")
    lines += ["", *notes(payload)]
    return "\n".join(lines) + "\n"


def notes(payload: dict) -> list[str]:
    """The sentences that must accompany the figures."""
    summary = payload["summary"]
    out = []
    if payload.get("interrupted"):
        out.append("- **Interrupted**: the figures cover the runs completed before Ctrl-C.")
    if summary["greedy_mismatches"]:
        out.append(f"- **BUG: {len(summary['greedy_mismatches'])} greedy output(s) differ from vanilla's** "
                   "(see `summary.greedy_mismatches`). In float32 they must be identical; in float16 / bfloat16 "
                   "batched verification can round differently from one-token decoding.")
    else:
        checked = sorted({r["method"] for r in summary["variants"] if r.get("compared_to_vanilla")} - {"vanilla"})
        if checked:
            out.append(f"- Every greedy output ({', '.join(checked)}) is identical to vanilla's, token for token.")
        elif not any(r["method"] == "vanilla" for r in summary["variants"]):
            out.append("- Greedy outputs were not checked against vanilla: vanilla was not run.")
    best = best_sdsat_greedy(summary)
    if best is not None:
        line = (f"- Best SDSAT greedy setting: {best['label'].removeprefix('sdsat_greedy ')}, "
                f"{best['median_speedup']:.2f}× vanilla, "
                f"{best['tokens_per_forward_pass']:.2f} tokens per forward pass, "
                f"{best['mean_tokens_per_iteration']:.2f} tokens per iteration (bonus counted)")
        if best.get("median_speedup_vs_prompt_lookup") is not None:
            line += f", {best['median_speedup_vs_prompt_lookup']:.2f}× prompt_lookup"
        out.append(line + ".")
    p1 = payload.get("pass_at_1")
    if p1:
        same = "equal for every greedy method, as identical outputs imply" if p1["greedy_equal"] else \
            "**NOT equal across greedy methods: a bug**"
        out.append(f"- HumanEval pass@1 (one greedy sample per problem, run in a subprocess with a "
                   f"{p1['timeout_seconds']:g} s timeout): {same}. Sampled rows use one sample per problem.")
    out.append("- Speed-up: tokens/s of the method ÷ tokens/s of vanilla on the same prompt in the same run, "
               "median over prompts; overall: all new tokens ÷ all seconds, against vanilla's on the same prompts; "
               "Spec-Bench: mean tokens/s over prompts ÷ vanilla's mean (Spec-Bench's speed-up ratio). "
               "Tokens per forward pass: new tokens ÷ forward passes of the model (vanilla = 1.0). "
               "Acceptance by position i: share of the iterations drafting position i that accepted it.")
    out.append(f"- Command: `{payload['meta']['command']}`")
    return out


def summary_rows(payload: dict) -> dict:
    """The table as data, for `summary.json` (what the app's Benchmark tab shows): rows plus notes."""
    pass_at_1 = (payload.get("pass_at_1") or {}).get("by_variant", {})
    rows = []
    for row in payload["summary"]["variants"]:
        p1 = pass_at_1.get(row["label"])
        rows.append({key: "–" if value in (None, []) else value for key, value in {
            "method": row["label"],
            "tokens/s": row["median_tokens_per_second"],
            "speed-up vs vanilla (median)": row["median_speedup"],
            "overall speed-up vs vanilla": row.get("overall_speedup"),
            "Spec-Bench speed-up vs vanilla": row.get("spec_bench_speedup"),
            "speed-up vs prompt_lookup": row.get("median_speedup_vs_prompt_lookup"),
            "tokens / forward pass": row["tokens_per_forward_pass"],
            "tokens / iteration (bonus counted)": row["mean_tokens_per_iteration"],
            "acceptance by draft position": [round(a, 2) for a in row["acceptance_by_position"]],
            "identical to vanilla": (f"{row['identical_to_vanilla']}/{row['compared_to_vanilla']}"
                                     if "identical_to_vanilla" in row else "n/a (sampled)"),
            "HumanEval pass@1": None if p1 is None else p1["pass_at_1"],
        }.items()})
    machine = payload["meta"]["machine"]
    return {
        "rows": rows,
        "source": payload["meta"]["source"],
        "prompts": len(payload["prompts"]),
        "machine": f"{machine['cpu']}, {machine['cores_available']} cores, {machine['torch_threads']} torch threads, "
                   f"{machine['device']} {machine['dtype']}, torch {machine['torch']}",
        "model": payload["meta"]["model"]["name"],
        "max new tokens": payload["meta"]["settings"]["max_new_tokens"],
        "date": payload["meta"]["date"],
        "command": payload["meta"]["command"],
        "notes": notes(payload)[:-1],  # the command is already a field
    }
