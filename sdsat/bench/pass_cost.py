"""`python -m sdsat.bench.pass_cost`: what one forward pass over T new tokens costs, relative to one token.

Speculative decoding pays off when tokens per forward pass exceed the relative cost of its wider
passes: speed-up ≈ tokens per pass ÷ cost(T) / cost(1). On a GPU cost(T) stays near cost(1) for small
T; on a CPU a one-token pass multiplies matrices by a vector, a wider one by a matrix, and the two
kernels differ. This measures it on the loaded model, with a KV cache of `--context` tokens, for
plain causal blocks (what vanilla, prompt lookup and SDSAT's verify pass feed) and for SDSAT draft
blocks [token, SAT x k]. Sizes are interleaved in every repeat; medians are reported.
`--compare-sat-updates` measures draft passes with the SAT rows' update compiled (`sdsat/sat_kernel.py`) and as
PyTorch's ops, in SDSAT's form of `--precision` (default bfloat16), switching round by round.
`--compare-kernels` measures with the routed CPU kernels (`sdsat/cpu_kernels.py`) and with plain
`nn.Linear`, switching between them round by round. `--compare-forms` measures, in `--precision`, every
row-invariant form's attention (tuning.exact_forms) on the row-invariant products, switching round by round,
and compares each form's passes with the cheapest one-token pass among them (issue 38's aims: SDSAT's form
against the per-row form the fastest vanilla may run in, and a draft pass against a plain pass as wide).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from .. import timing
from ..kvcache import new_cache, rollback


def measure(engine, sizes: list[int], context: int, repeats: int, seed: int = 0) -> dict:
    """Median seconds per pass: {"plain": {T: s}, "draft": {k: s}} (draft blocks are k + 1 tokens)."""
    return measure_settings(engine, sizes, context, repeats, {"": lambda: None}, seed)[""]


def measure_settings(engine, sizes: list[int], context: int, repeats: int, settings: dict, seed: int = 0) -> dict:
    """`measure` under each setting ({name: function that applies it}), interleaved round by round."""
    model, sat_model = engine.model, engine.sat_model
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    device = sat_model.device
    cache = new_cache(model.config)
    with torch.inference_mode():
        sat_model.forward(torch.randint(0, vocab, (1, context), generator=gen).to(device), cache=cache,
                          logits_to_keep=1)
    times = {name: {"plain": {t: [] for t in sizes},
                    "draft": {t - 1: [] for t in sizes if 1 <= t - 1 <= sat_model.max_k}} for name in settings}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for name, apply in settings.items():
            apply()
            for kind, table in times[name].items():
                for size in table:
                    ids = torch.randint(0, vocab, (1, size if kind == "plain" else size + 1), generator=gen).to(device)
                    slots = (None if kind == "plain"
                             else torch.cat([torch.tensor([-1]), torch.arange(size)])[None].to(device))
                    start = timing.now(device)
                    with torch.inference_mode():
                        sat_model.forward(ids, slots, cache=cache, logits_to_keep=ids.shape[1])
                    table[size].append(timing.now(device) - start)
                    rollback(cache, context)
    return {name: {kind: {size: statistics.median(v[1:]) for size, v in table.items()} for kind, table in kinds.items()}
            for name, kinds in times.items()}


def report(costs: dict, context: int) -> str:
    """The table of one setting's `measure`."""
    return compare_report({"": costs}, context)


def compare_report(results: dict[str, dict], context: int) -> str:
    """One table with a column pair (ms, relative to that setting's one-token pass) per setting."""
    names = list(results)
    first = results[names[0]]
    lines = [f"KV cache of {context} tokens; median ms per pass, and relative to the same setting's one-token pass", "",
             "| block | tokens | " + " | ".join(f"{n}: ms | {n}: relative" if n else "ms | relative" for n in names)
             + " |",
             "|---|---:|" + "---:|---:|" * len(names)]
    for kind, label in (("plain", "plain causal"), ("draft", "draft [t, SAT×{}]")):
        for size in first[kind]:
            cells = []
            for name in names:
                costs = results[name]
                s, one = costs[kind][size], costs["plain"][min(costs["plain"])]
                cells.append(f"{s * 1e3:.1f} | {s / one:.2f}×")
            tokens = size if kind == "plain" else size + 1
            lines.append(f"| {label.format(size)} | {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def forms_summary(results: dict[str, dict]) -> str:
    """Each form's one-token pass against the cheapest among the forms, and its draft passes against a plain
    pass of the same width in the same form."""
    cheapest = min(results, key=lambda name: results[name]["plain"][1])
    lines = [f"one-token pass against {cheapest}'s ({results[cheapest]['plain'][1] * 1e3:.1f} ms):"]
    for name, costs in results.items():
        ratios = [f"[t, SAT×{k}] {s / costs['plain'][k + 1]:.2f}× plain {k + 1}" for k, s in costs["draft"].items()
                  if k + 1 in costs["plain"]]
        lines.append(f"- {name}: {costs['plain'][1] / results[cheapest]['plain'][1]:.3f}×"
                     + (f"; draft pass {', '.join(ratios)}" if ratios else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.pass_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8, 12, 16], metavar="T",
                        help="block sizes in new tokens per pass (default 1 2 3 4 6 8 12 16)")
    parser.add_argument("--context", type=int, default=256, metavar="N",
                        help="tokens already in the KV cache (default 256)")
    parser.add_argument("--repeats", type=int, default=15, metavar="N",
                        help="timed rounds over every size; the median is reported (default 15)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    parser.add_argument("--model", default=None, metavar="ID_OR_DIR",
                        help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--no-cpu-kernels", action="store_true",
                        help="on a CPU, multiply with nn.Linear as is, not with the fastest "
                       "measured kernel per row count (cpu_kernels.py; default off: routed)")
    parser.add_argument("--compare-kernels", action="store_true",
                        help="measure with the routed CPU kernels and with nn.Linear as is, interleaved round by round "
                             "(default off)")
    parser.add_argument("--compare-forms", action="store_true",
                        help="measure every row-invariant form of attention in --precision, interleaved round by "
                             "round (default off)")
    parser.add_argument("--compare-sat-updates", action="store_true",
                        help="measure the SAT rows' update compiled (sdsat/sat_kernel.py) and as PyTorch's ops, "
                             "interleaved round by round (default off)")
    parser.add_argument("--precision", choices=("float32", "bfloat16"),
                        help="convert the model to this precision first (default: as loaded; --compare-forms: "
                             "bfloat16)")
    parser.add_argument("--json", metavar="OUT",
                        help="also write the medians (seconds) and the machine here (default: none)")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.context < 1 or args.repeats < 1:
        parser.error("--tokens, --context and --repeats must be at least 1")

    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig, ModelLoadError
    from .runner import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, cpu_kernels=not args.no_cpu_kernels))
    except (ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sizes = sorted(set(args.tokens) | {1})
    precision = args.precision or ("bfloat16" if args.compare_forms else None)
    if args.compare_sat_updates:  # in the form SDSAT decodes in (the first row-invariant form its tuning tries)
        from .. import tuning

        precision = precision or "bfloat16"
        tuning.set_precision(engine.sat_model, precision, not args.no_cpu_kernels, tuning.exact_forms(precision)[0])
    elif precision and not args.compare_forms:  # in the form a plain start loads
        from .. import tuning

        tuning.set_precision(engine.sat_model, precision, not args.no_cpu_kernels, tuning.ROUTED)
    if args.compare_forms:
        from .. import native, tuning

        native.build()  # the compiled form is among the forms where it builds
        forms = tuning.exact_forms(precision)
        tuning.set_precision(engine.sat_model, precision, not args.no_cpu_kernels, forms[-1])
        if tuning.form_of(engine.model) != forms[-1]:
            print("error: --compare-forms needs a CPU whose torch runs the row-invariant products", file=sys.stderr)
            return 2
        model = engine.model
        settings = {form: (lambda name=tuning.ATTENTION_OF[form]: model.set_attn_implementation(name))
                    for form in forms}
        results = measure_settings(engine, sizes, args.context, args.repeats, settings)
        text = compare_report(results, args.context) + "\n\n" + forms_summary(results)
    elif args.compare_sat_updates:
        from .. import sat_kernel

        if sat_kernel.build() is None:
            print("error: --compare-sat-updates: the compiled update cannot be built here (see the log), or "
                  "SDSAT_SAT_KERNEL=0", file=sys.stderr)
            return 2
        settings = {"compiled update": lambda: os.environ.__setitem__("SDSAT_SAT_KERNEL", "1"),
                    "PyTorch's ops": lambda: os.environ.__setitem__("SDSAT_SAT_KERNEL", "0")}
        results = measure_settings(engine, sizes, args.context, args.repeats, settings)
        os.environ["SDSAT_SAT_KERNEL"] = "1"
        text = compare_report(results, args.context) + "\n\n" + forms_summary(results)
    elif args.compare_kernels:
        from .. import cpu_kernels

        model = engine.model
        plan = cpu_kernels.installed_plan(model)
        if plan is None:
            print("error: --compare-kernels needs a model on the CPU with routed kernels", file=sys.stderr)
            return 2
        settings = {"routed kernels": lambda: cpu_kernels.install(model, plan),
                    "nn.Linear": lambda: cpu_kernels.uninstall(model)}
        results = measure_settings(engine, sizes, args.context, args.repeats, settings)
        cpu_kernels.install(model, plan)
        text = compare_report(results, args.context)
    else:
        results = measure(engine, sizes, args.context, args.repeats)
        text = report(results, args.context)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"context": args.context, "repeats": args.repeats,
                                               "machine": machine_info(engine), "seconds": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
