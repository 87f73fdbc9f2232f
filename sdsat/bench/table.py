"""The results as a markdown table, with the machine and settings they were measured under."""

from __future__ import annotations

from .stats import best_sdsat_greedy, headline_speedup


def _num(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _load(values) -> str:
    return "–" if not values else f"{values[0]:.1f}"  # the 1-minute figure


def _acceptance(row: dict, positions: int = 4) -> str:
    acc = row["acceptance_by_position"][:positions]
    return (" ".join(f"{a:.2f}" for a in acc) + (" …" if len(row["acceptance_by_position"]) > positions else "")
            if acc else "–")


def cpu_line(machine: dict) -> str:
    """The processor with the kernel flags its speed-ups depend on, e.g. "AMD EPYC 7R13 (avx2, avx512f)"."""
    flags = machine.get("cpu_flags")
    if flags is None:  # results written before the flags were recorded
        return machine["cpu"]
    return f"{machine['cpu']} (flags: {', '.join(flags) if flags else 'none of avx2, AVX-512, AMX'})"


def _speedups(row: dict, suffix: str = "", spec_bench: bool = True) -> str:
    """"1.50× (1.20–1.80; overall 1.45×; Spec-Bench 1.47×)" from the row's fields ending in `suffix`."""
    median = row.get(f"median_speedup{suffix}")
    if median is None:
        return "–"
    overall, spec = row.get(f"overall_speedup{suffix}"), row.get("spec_bench_speedup") if spec_bench else None
    return (f"{median:.2f}× ({row[f'min_speedup{suffix}']:.2f}–{row[f'max_speedup{suffix}']:.2f}"
            + (f"; overall {overall:.2f}×" if overall else "") + (f"; Spec-Bench {spec:.2f}×)" if spec else ")"))


def markdown_table(payload: dict) -> str:
    """The summary table of a results payload (as written by `--json`), with a header and notes."""
    meta, summary = payload["meta"], payload["summary"]
    machine, settings = meta["machine"], meta["settings"]
    pass_at_1 = (payload.get("pass_at_1") or {}).get("by_variant", {})
    numerics = " ".join(filter(None, (machine["dtype"], machine.get("form"))))  # e.g. "float32 row-invariant"
    lines = [
        f"**{meta['source']}**, {len(payload['prompts'])} prompts, up to {settings['max_new_tokens']} new tokens, "
        f"{settings['repeats']} repeat(s); model `{meta['model']['name']}` ({numerics}, {machine['device']}); "
        f"{cpu_line(machine)}, {machine['cores_available']} cores, {machine['torch_threads']} torch threads; "
        f"torch {machine['torch']}, transformers {machine['transformers']}; load average "
        f"{_load(machine.get('load_average_at_start'))} at start, {_load(machine.get('load_average_at_end'))} at end; "
        f"{meta['date']}.",
        "",
        "| method | tokens/s (median) | speed-up vs fastest vanilla (median, min–max; overall) "
        "| speed-up vs vanilla (median, min–max; overall; Spec-Bench) "
        "| tokens / forward pass "
        "| mean tokens / iteration (bonus counted) | acceptance by draft position 1.. "
        "| identical to vanilla | HumanEval pass@1 |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in summary["variants"]:
        fastest = _speedups(row, "_vs_fastest_vanilla", spec_bench=False)
        speedup = _speedups(row)
        if row.get("median_speedup_vs_prompt_lookup") is not None:
            speedup += f"; {row['median_speedup_vs_prompt_lookup']:.2f}× vs prompt_lookup"
        if "median_speedup_vs_vanilla_sample" in row and row["median_speedup_vs_vanilla_sample"] is not None:
            speedup += f"; {row['median_speedup_vs_vanilla_sample']:.2f}× vs vanilla_sample"
        identical = (f"{row['identical_to_vanilla']}/{row['compared_to_vanilla']}" if "identical_to_vanilla" in row
                     else f"n/a ({row['precision']})" if row.get("precision") else "n/a (sampled)")
        if "identical_to_vanilla" in row and row["identical_to_vanilla"] != row["compared_to_vanilla"]:
            identical = f"**{identical} MISMATCH**"
        p1 = pass_at_1.get(row["label"])
        passed = "–" if p1 is None else f"{p1['pass_at_1']:.3f} ({p1['passed']}/{p1['total']})"
        lines.append(
            f"| {row['label']} | {_num(row['median_tokens_per_second'], '.1f')} | {fastest} | {speedup} "
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
    out += _baseline_notes(payload) + _auto_notes(payload)
    best = best_sdsat_greedy(summary)
    if best is not None:
        vs = f"{best['median_speedup']:.2f}× vanilla"
        if best.get("median_speedup_vs_fastest_vanilla") is not None:
            vs = f"{headline_speedup(best):.2f}× the fastest vanilla, {vs}"
        line = (f"- Best SDSAT greedy setting: {best['label'].removeprefix('sdsat_greedy ')}, {vs}, "
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
               "median over prompts (vs fastest vanilla: ÷ the fastest vanilla run of any precision on that prompt); "
               "overall: all new tokens ÷ all seconds, against vanilla's on the same prompts; "
               "Spec-Bench: mean tokens/s over prompts ÷ vanilla's mean (Spec-Bench's speed-up ratio). "
               "Tokens per forward pass: new tokens ÷ forward passes of the model (vanilla = 1.0). "
               "Acceptance by position i: share of the iterations drafting position i that accepted it.")
    out.append(f"- Command: `{payload['meta']['command']}`")
    return out


def _baseline_notes(payload: dict) -> list[str]:
    """Which precision's vanilla was fastest: the baseline of the headline speed-ups."""
    fastest = payload["summary"].get("fastest_vanilla")
    vanillas = [r for r in payload["summary"]["variants"] if r["method"] == "vanilla"]
    if not fastest or not vanillas:
        return []
    meta = payload["meta"]
    forms = {p: f"{p} {b['form']}" if b.get("form") else p for p, b in (meta.get("baselines") or {}).items()}
    main = " ".join(filter(None, (meta["machine"]["dtype"], meta["machine"].get("form"))))
    names = {r["label"]: f"{forms.get(r['precision'], r['precision']) if r['precision'] else main} (`{r['label']}`)"
             for r in vanillas}
    prompts = len(fastest["by_prompt"])
    if len(vanillas) == 1:
        return [f"- Fastest vanilla: {names[vanillas[0]['label']]}, the only precision vanilla ran in; speed-ups vs "
                "the fastest vanilla equal those vs vanilla."]
    counts = "; ".join(f"{names[r['label']]} on {fastest['counts'].get(r['label'], 0)} of {prompts} prompts"
                       for r in sorted(vanillas, key=lambda r: -fastest["counts"].get(r["label"], 0)))
    return [f"- Fastest vanilla: {counts}. Vanilla in other precisions or kernel forms ran on engines of their "
            f"own, interleaved with the other methods; \"identical to vanilla\" compares with vanilla in {main}, "
            "the numerics every other method decoded in."]


def _auto_notes(payload: dict) -> list[str]:
    """What the auto recipe chose, why, and what it was predicted to give against what it gave."""
    out = []
    for row in payload["summary"]["variants"]:
        auto = row.get("auto")
        if not auto:
            continue
        plan = auto.get("plan")
        if plan is None:
            out.append(f"- `{row['label']}`: no plan ({auto.get('note') or 'no tuning'}); it ran the default settings.")
            continue
        out.append(f"- `{row['label']}` (the tuning's plan): {plan['reason']}. Measured here: "
                   f"{_num(headline_speedup(row), '.2f', '×')} the fastest vanilla.")
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
            "speed-up vs fastest vanilla (median)": row.get("median_speedup_vs_fastest_vanilla"),
            "overall speed-up vs fastest vanilla": row.get("overall_speedup_vs_fastest_vanilla"),
            "overall speed-up vs vanilla": row.get("overall_speedup"),
            "Spec-Bench speed-up vs vanilla": row.get("spec_bench_speedup"),
            "speed-up vs prompt_lookup": row.get("median_speedup_vs_prompt_lookup"),
            "speed-up vs vanilla_sample (median)": row.get("median_speedup_vs_vanilla_sample"),
            "tokens / forward pass": row["tokens_per_forward_pass"],
            "tokens / iteration (bonus counted)": row["mean_tokens_per_iteration"],
            "acceptance by draft position": [round(a, 2) for a in row["acceptance_by_position"]],
            "identical to vanilla": (f"{row['identical_to_vanilla']}/{row['compared_to_vanilla']}"
                                     if "identical_to_vanilla" in row else
                                     f"n/a ({row['precision']})" if row.get("precision") else "n/a (sampled)"),
            "HumanEval pass@1": None if p1 is None else p1["pass_at_1"],
        }.items()})
    machine = payload["meta"]["machine"]
    return {
        "rows": rows,
        "source": payload["meta"]["source"],
        "prompts": len(payload["prompts"]),
        "machine": f"{cpu_line(machine)}, {machine['cores_available']} cores, "
                   f"{machine['torch_threads']} torch threads, {machine['device']} {machine['dtype']}, "
                   f"torch {machine['torch']}",
        "model": payload["meta"]["model"]["name"],
        "max new tokens": payload["meta"]["settings"]["max_new_tokens"],
        "date": payload["meta"]["date"],
        "command": payload["meta"]["command"],
        "notes": notes(payload)[:-1],  # the command is already a field
    }
