"""`python -m sdsat.bench`: race SDSAT against vanilla decoding and transformers' decoders.

Writes OUT_DIR/results.json (every run and the summary, rewritten after each prompt), results.md
(the table, also printed on stdout), summary.json (the table as data, which the app's Benchmark tab
shows) and the figures as HTML and PNG. Progress goes to stderr.
Exit status: 0 done, 3 a greedy output differed from vanilla's (a bug), 130 interrupted (Ctrl-C at
any point, pass@1 and figures included; the runs completed so far are kept), 2 bad arguments or any
other error (one line). Prompts too long for the model's context are skipped with one line each.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUICK = dict(limit=3, max_new_tokens=32, k=[1, 2, 4], sample_k=2, temperatures=[1.0], repeats=1, warmup_tokens=4)
BASELINE_CHOICES = ("auto", "none", "float32", "float16", "bfloat16")
DEFAULTS = dict(limit=None, max_new_tokens=256, k=None, sample_k=4, temperatures=[0.2, 1.0], repeats=1,
                warmup_tokens=16)


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    """What races, and each method's settings."""
    from ..sampling import MAX_TOP_K
    from .methods import METHODS

    what = parser.add_argument_group("methods")
    what.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="METHOD",
                      help=f"any of {', '.join(METHODS)} (default: all)")
    what.add_argument("--k", nargs="+", type=int, metavar="K",
                      help="sdsat_greedy's k sweep, drafts per step (default: 1..the SATs' max k; 1 2 4 with --quick)")
    what.add_argument("--schemes", nargs="+", default=["two_step"], metavar="RECIPE",
                      help="SDSAT recipes to race (a decoding scheme with prompt lookup and the draft tree on or off): "
                           "two_step (the paper), fused, lookup (two_step with "
                           "prompt lookup's copies, --lookup-tokens of them, verified when found), tree (two_step "
                           "whose verify pass also checks --tree-candidates of the SATs' runner-ups, sampled: "
                           "further draws), "
                           "lookup_tree (both) and/or auto (scheme, k, lookup and tree from this machine's tuning; "
                           "ignores --k and --sample-k) (default two_step)")
    what.add_argument("--sample-k", type=int, metavar="K",
                      help="sdsat_sample's k, drafts per step (default 4, capped at the max k; 2 with --quick)")
    what.add_argument("--temperatures", nargs="+", type=float, metavar="T",
                      help="temperatures of vanilla_sample and sdsat_sample (default 0.2 1.0; 1.0 with --quick)")
    what.add_argument("--top-p", type=float, default=1.0, metavar="P",
                      help="nucleus for sampling: probability mass kept, in (0, 1] (default 1: off)")
    what.add_argument("--top-k", type=int, default=0, metavar="N",
                      help=f"sampling keeps the N likeliest tokens, 0..{MAX_TOP_K} (default 0: off)")
    what.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed base (default 0)")
    what.add_argument("--lookup-tokens", type=int, default=10, metavar="N",
                      help="tokens copied per lookup: prompt_lookup_num_tokens and the lookup recipes' (default 10)")
    what.add_argument("--lookup-ngram", type=int, default=2, metavar="N",
                      help="prompt lookup's max_matching_ngram_size, and the shortest recurring suffix "
                           "(lookup_ngram) after which the lookup recipes copy, in tokens (default 2)")
    what.add_argument("--tree-candidates", type=int, default=2, metavar="N",
                      help="the tree recipes' runner-up candidates per verify pass, 1..8 (default 2)")
    what.add_argument("--baseline-precisions", nargs="+", default=["auto"], choices=BASELINE_CHOICES,
                      metavar="PRECISION",
                      help="precisions vanilla also runs in, each on an engine of its own, so that speed-ups are "
                           "also against the fastest vanilla: auto (those the tuner measures: float32 and bfloat16 "
                           "on a CPU, none elsewhere), none, or any of float32 float16 bfloat16 (default auto)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("prompts")
    source.add_argument("--prompts", metavar="FILE", help='JSON lines {"prompt": ..., "kind": "completion"|"chat"}; '
                        "default: HumanEval")
    source.add_argument("--subset", metavar="SPEC",
                        help='which prompts, e.g. "0-19,42" or "HumanEval/7" (ranges inclusive; default: all)')
    source.add_argument("--limit", type=int, metavar="N",
                        help="at most N prompts, after --subset (default: all; 3 with --quick)")
    _add_method_options(parser)
    how = parser.add_argument_group("measurement")
    how.add_argument("--max-new-tokens", type=int, metavar="N",
                     help="new tokens per generation (default 256; 32 with --quick)")
    how.add_argument("--repeats", type=int, metavar="N", help="timed runs per prompt and method (default 1)")
    how.add_argument("--warmup-tokens", type=int, metavar="N",
                     help="tokens of the untimed warm-up run per method (default 16, 4 with --quick; 0: none)")
    how.add_argument("--quick", action="store_true",
                     help="a few minutes on 2 CPU cores: 3 prompts, 32 tokens, k 1 2 4, T 1.0 (explicit options win; "
                          "default off)")
    how.add_argument("--pass-at-1", action=argparse.BooleanOptionalAction, default=None,
                     help="score HumanEval pass@1 (default: on for HumanEval, off for a --prompts file)")
    how.add_argument("--exec-timeout", type=float, default=10.0, metavar="S",
                     help="wall seconds per HumanEval program run for pass@1 (default 10)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="ID_OR_DIR",
                       help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--adapter", metavar="DIR",
                       help="SAT adapter folder (default: the model's own or the shipped one)")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="weights' dtype (default auto: float32 on a CPU; on a GPU a known checkpoint's own, "
                            "else bfloat16)")
    model.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                       help="where the model runs (default auto: cuda if available, else mps, else cpu)")
    model.add_argument("--no-cpu-kernels", action="store_true",
                       help="on a CPU, multiply with nn.Linear as is, not with the fastest "
                       "measured kernel per row count (cpu_kernels.py; default off: routed)")
    model.add_argument("--threads", type=int, metavar="N",
                       help="torch threads (default: torch's choice); on a busy machine 1 avoids oversubscription")
    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", default="runs/bench", metavar="DIR",
                     help="folder for figures, results.md, summary.json and results.json (default runs/bench)")
    out.add_argument("--json", metavar="OUT", help="results JSON path (default OUT_DIR/results.json)")
    out.add_argument("--no-figures", action="store_true", help="skip the figures (default off: HTML and PNG)")
    out.add_argument("--no-png", action="store_true", help="HTML figures only (default off: HTML and PNG)")
    out.add_argument("--plotlyjs", default="cdn", choices=["cdn", "directory", "inline"],
                     help="how the HTML figures get plotly.js (default cdn; inline works offline, ~4.6 MB each)")
    out.add_argument("--quiet", action="store_true", help="no progress bars (default off)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name in ("limit", "max_new_tokens", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup_tokens < 0:
        parser.error("--warmup-tokens must be 0 or more")
    if len(args.baseline_precisions) > 1 and {"auto", "none"} & set(args.baseline_precisions):
        parser.error("--baseline-precisions takes auto, none, or a list of float32 float16 bfloat16, not a mix")
    return args


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


class _Refused(Exception):
    """A setting or prompt set the benchmark cannot run: one line on stderr, exit status 2."""


@dataclass
class _Bench:
    """What a run races: the engines, the settings, the variants and the prompts that fit."""

    engine: Any  # the main engine: every method runs on it
    baselines: dict  # precision -> Engine: vanilla's other precisions
    config: Any  # runner.BenchConfig
    variants: list
    prompts: list
    prompt_ids: list[list[int]]
    skipped: list[dict]  # prompts too long for the model's context


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out_dir = Path(args.out_dir)
    json_path = Path(args.json) if args.json else out_dir / "results.json"
    try:
        bench = _prepare(args)
    except _Refused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    use_pass_at_1 = args.pass_at_1 if args.pass_at_1 is not None else not args.prompts
    if use_pass_at_1 and args.prompts:
        print("warning: --pass-at-1 needs HumanEval prompts; skipped", file=sys.stderr)
        use_pass_at_1 = False
    meta = _meta(args, argv, bench)
    bar_options = dict(file=sys.stderr, disable=args.quiet, dynamic_ncols=True)
    runs, interrupted = _time_runs(bench, meta, json_path, bar_options)
    prompts = bench.prompts

    from .report import build_payload, write_json

    meta["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    payload = build_payload(meta, prompts, runs, interrupted=interrupted, complete=not interrupted)
    write_json(payload, json_path)
    if not runs:
        print(f"no completed runs; wrote {json_path}", file=sys.stderr)
        return 130 if interrupted else 1
    try:
        written = _finish(args, payload, prompts, runs, json_path, out_dir, use_pass_at_1, bar_options)
    except KeyboardInterrupt:  # during pass@1 or the figures: the runs are on disk already
        print(f"\ninterrupted: the {len(runs)} completed runs are in {json_path}", file=sys.stderr)
        return 130
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    if _report_mismatches(payload["summary"]["greedy_mismatches"]):
        return 3
    return 130 if interrupted else 0


def _prepare(args) -> _Bench:
    """Prompts, the engines and the variants to race."""
    import torch

    from ..engine import Engine, SatSource
    from ..models import DEFAULT_MODEL, LoadConfig, ModelLoadError
    from ..sampling import SamplingConfig
    from .methods import AUTO, auto_choices, plan_variants
    from .prompts import PromptFileError, file_prompts, humaneval_prompts
    from .runner import BenchConfig, encode_prompts, fitting_prompts

    for flag, setting in (("--top-p", dict(top_p=args.top_p)), ("--top-k", dict(top_k=args.top_k))):
        try:  # the sampling config's own range check
            SamplingConfig(do_sample=True, **setting).validate()
        except ValueError as err:
            raise _Refused(f"{flag}: {err}") from None
    try:
        prompts = (file_prompts(args.prompts, args.subset, args.limit) if args.prompts
                   else humaneval_prompts(args.subset, args.limit))
    except (PromptFileError, ValueError) as err:
        raise _Refused(err) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, dtype=args.dtype, device=args.device,
                                        cpu_kernels=not args.no_cpu_kernels),
                             SatSource(adapter=args.adapter))
    except (ModelLoadError, ValueError) as err:
        raise _Refused(err) from None
    # The auto recipe's plan; tuning may move the model to the precision it chose, before anything is timed.
    wants_auto = AUTO in args.schemes and any(m.startswith("sdsat") for m in args.methods)
    # A kept measurement taken under load is measured again: a benchmark's plan is never a busy spell's.
    # A run of chat prompts alone takes the chat plan (where the SATs ship a chat trace), as the page's Chat does.
    auto = (auto_choices(engine.tune(remeasure="noisy"), engine.max_k, args.temperatures, args.top_p,
                         args.top_k, chat=all(p.kind == "chat" for p in prompts))
            if wants_auto else None)
    k_list = args.k if args.k else list(range(1, engine.max_k + 1))
    config = BenchConfig(methods=args.methods, k_list=k_list, sample_k=min(args.sample_k, engine.max_k),
                         temperatures=args.temperatures, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                         max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup_tokens=args.warmup_tokens,
                         lookup_tokens=args.lookup_tokens, lookup_ngram=args.lookup_ngram,
                         tree_candidates=args.tree_candidates)
    precisions = baseline_precisions(args, engine)
    try:
        variants = plan_variants(config.methods, k_list, config.sample_k, config.temperatures,
                                 config.lookup_tokens, engine.max_k, tuple(args.schemes), config.tree_candidates,
                                 auto=auto, baselines=tuple(precisions))
    except ValueError as err:
        raise _Refused(err) from None
    baselines = _load_baselines(args, precisions)
    max_context = getattr(engine.model.config, "max_position_embeddings", None)
    prompts, prompt_ids, skipped = fitting_prompts(prompts, encode_prompts(engine, prompts), variants, config,
                                                   max_context)
    for s in skipped:
        print(f"skipped prompt {s['name']}: {s['prompt_tokens']} tokens, plus {config.max_new_tokens} new tokens and "
              f"the drafts' reach, need {s['needed']} positions; the model's context is {s['max_context']}",
              file=sys.stderr)
    if not prompts:
        raise _Refused(f"none of the prompts fits the model's context of {max_context} tokens with "
                       f"--max-new-tokens {config.max_new_tokens}")
    return _Bench(engine, baselines, config, variants, prompts, prompt_ids, skipped)


def baseline_precisions(args, engine) -> dict[str, str | None]:
    """The precisions vanilla also runs in, each on an engine of its own, and the kernel form it runs in there
    (tuning.ROUTED, tuning.ROUTED_COMPILED or one of EXACT_FORMS; None: see below); none without vanilla.

    Each precision runs in the form the tuning timed fastest for a one-token pass, or the routed form a plain
    start loads when it did not time the routed form. Another precision the main engine's tuning did not time
    (every one without an auto recipe; all but one with --dtype) maps to None: its own engine then takes the form
    the tuning kept for that precision on this machine, if any, else the routed one (`_load_baselines`). The main
    engine's own precision, untimed, stays in the routed form its vanilla decodes in. The main engine's
    own precision is among them only when that form is not the main engine's (tuning may have left it in a
    row-invariant form whose vanilla is slower than another form's).
    """
    from ..tuning import ROUTED, dtype_name, form_of, precisions_to_try

    if "vanilla" not in args.methods or args.baseline_precisions == ["none"]:
        return {}
    wanted = (precisions_to_try(engine.model, fixed=False) if args.baseline_precisions == ["auto"]
              else args.baseline_precisions)
    tuning = getattr(engine, "tuning", None)
    forms = {}
    for precision in dict.fromkeys(wanted):
        form = _fastest_vanilla_form(tuning, precision)
        if form is None and precision == dtype_name(engine.model):
            form = ROUTED  # the main engine's own precision, untimed: the form a plain start loads
        if (precision, form) != (dtype_name(engine.model), form_of(engine.model)):
            forms[precision] = form
    return forms


def _fastest_vanilla_form(tuning, precision: str) -> str | None:
    """The form whose one-token pass `tuning` timed fastest in `precision`; None where it did not time that
    precision (an engine loaded in one fixed precision tunes that one alone)."""
    from ..tuning import EXACT_FORMS, ROUTED

    if tuning is None or precision not in tuning.forms:
        return None
    if tuning.forms[precision] not in EXACT_FORMS:
        return ROUTED
    timed = tuning.forms_timed(precision)
    return min(timed, key=timed.__getitem__) if ROUTED in timed else ROUTED


def _load_baselines(args, forms: dict[str, str | None]) -> dict:
    """An engine per baseline precision, loaded as a plain start loads it (its own kernel plan for that
    precision), then put in the form the tuning timed fastest where that is not the routed one (for a form of
    None, the fastest that the tuning kept on this machine for that precision times)."""
    from ..engine import Engine, SatSource
    from ..models import DEFAULT_MODEL, LoadConfig, ModelLoadError
    from ..tuning import ROUTED, form_of, in_form, set_precision

    baselines = {}
    for precision, form in forms.items():
        try:
            baselines[precision] = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, dtype=precision,
                                                          device=args.device, cpu_kernels=not args.no_cpu_kernels),
                                               SatSource(adapter=args.adapter))
        except (ModelLoadError, ValueError) as err:
            raise _Refused(f"--baseline-precisions {precision}: {err}") from None
        if form is None:  # the main engine's tuning did not time this precision: the tuning kept for it, if any
            form = _fastest_vanilla_form(baselines[precision].tune(remeasure="never"), precision) or ROUTED
        # a plain start's form is the routed one; reading a kept tuning may have moved it to the tuning's own
        engine, kernels = baselines[precision], not args.no_cpu_kernels
        off_routed = form != ROUTED or form_of(engine.model) != ROUTED  # wanted or current form not the plain one
        if off_routed and not in_form(engine.sat_model, precision, kernels, form):
            set_precision(engine.sat_model, precision, kernels, form)
    return baselines


def _meta(args, argv, bench: _Bench) -> dict:
    """What every result depends on: the command, the commit, the model, the machine and the settings."""
    from .runner import baseline_info, git_commit, machine_info, now_iso

    engine, config = bench.engine, bench.config
    return {
        "date": now_iso(),
        "command": shlex.join(["python", "-m", "sdsat.bench", *(sys.argv[1:] if argv is None else argv)]),
        "git_commit": git_commit(),
        "source": f"prompts file {args.prompts}" if args.prompts else "HumanEval",
        "model": {"name": engine.name, "adapter": engine.sat_model.spec.adapter, "sat_kind": engine.sat_model.spec.kind,
                  "sat_trained": engine.sat_trained, "max_k": engine.max_k},
        "machine": machine_info(engine),
        "baselines": baseline_info(bench.baselines),
        "tuning": engine.tuning.to_dict() if engine.tuning is not None else None,
        "settings": {"methods": config.methods, "k": config.k_list, "schemes": args.schemes,
                     "sample_k": config.sample_k, "temperatures": config.temperatures, "top_p": config.top_p,
                     "top_k": config.top_k,
                     "seed": config.seed, "max_new_tokens": config.max_new_tokens, "repeats": config.repeats,
                     "warmup_tokens": config.warmup_tokens, "lookup_tokens": config.lookup_tokens,
                     "lookup_ngram": config.lookup_ngram, "tree_candidates": config.tree_candidates,
                     "baseline_precisions": list(bench.baselines), "quick": args.quick, "subset": args.subset,
                     "limit": args.limit, "variants": [v.label for v in bench.variants]},
        "skipped_prompts": bench.skipped,
    }


def _time_runs(bench: _Bench, meta: dict, json_path: Path, bar_options: dict) -> tuple[list[dict], bool]:
    """Warm up, then every run, saving after each prompt; Ctrl-C keeps what finished: (runs, interrupted)."""
    from tqdm import tqdm

    from .report import build_payload, write_json
    from .runner import measure_all, warm_up

    engine, variants, prompts, config = bench.engine, bench.variants, bench.prompts, bench.config
    runs: list[dict] = []
    try:
        for _ in tqdm(warm_up(engine, variants, bench.prompt_ids[0], config, bench.baselines),
                      total=len(variants) if config.warmup_tokens else 0,
                      desc="warm-up", unit="method", **bar_options):
            pass
        total = len(prompts) * config.repeats * len(variants)
        with tqdm(total=total, desc="bench", unit="run", **bar_options) as bar:
            per_prompt = config.repeats * len(variants)
            for measurement in measure_all(engine, variants, bench.prompt_ids, config, bench.baselines):
                runs.append(measurement.to_dict())
                bar.update()
                bar.set_postfix_str(f"prompt {measurement.prompt_index + 1}/{len(prompts)} {measurement.method} "
                                    f"{measurement.tokens_per_second:.1f} tok/s")
                if len(runs) % per_prompt == 0:  # a prompt is done: save what we have
                    write_json(build_payload(meta, prompts, runs), json_path)
    except KeyboardInterrupt:
        print(f"\ninterrupted: keeping the {len(runs)} completed runs", file=sys.stderr)
        return runs, True
    return runs, False


def _report_mismatches(mismatches: list[dict]) -> bool:
    """Say loudly which greedy outputs differ from vanilla's; True if any did."""
    if not mismatches:
        return False
    print("\n" + "!" * 78 + f"\nBUG: {len(mismatches)} greedy output(s) differ from vanilla decoding:", file=sys.stderr)
    for m in mismatches:
        print(f"  prompt {m['prompt_index']} repeat {m['repeat']} {m['label']}: first difference at token "
              f"{m['first_difference']}", file=sys.stderr)
    print("In float32 greedy outputs must be identical; please report this.\n" + "!" * 78, file=sys.stderr)
    return True


def _finish(args, payload: dict, prompts, runs: list[dict], json_path: Path, out_dir: Path, use_pass_at_1: bool,
            bar_options: dict) -> list[Path]:
    """After the runs: pass@1, the table and the figures; returns the files written."""
    from tqdm import tqdm

    from .figures import build_figures, write_figures
    from .report import write_json
    from .runner import score_pass_at_1
    from .table import markdown_table, summary_rows

    if use_pass_at_1:
        with tqdm(total=1, desc="pass@1", unit="step", **bar_options):
            payload["pass_at_1"] = score_pass_at_1(prompts, runs, timeout=args.exec_timeout)
        write_json(payload, json_path)
    table = markdown_table(payload)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(table, encoding="utf-8")
    write_json(summary_rows(payload), out_dir / "summary.json")
    print(table)
    written = [json_path, out_dir / "results.md", out_dir / "summary.json"]
    if not args.no_figures:
        paths, skipped = write_figures(build_figures(payload), out_dir, png=not args.no_png, plotlyjs=args.plotlyjs)
        written += paths
        if skipped and not args.no_png:
            print(f"warning: {skipped}; wrote the HTML figures only", file=sys.stderr)
    return written


if __name__ == "__main__":
    sys.exit(main())
