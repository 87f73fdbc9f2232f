"""`python -m sdsat generate`: one generation from the command line, with its statistics;
`python -m sdsat tune`: measure this machine for auto, once.

Decoding is greedy unless --sample or --temperature is given. Without --json the text streams to
stdout as it is decoded, followed by the statistics; with --json stdout holds exactly one JSON
object (GenerationResult.to_dict() plus the model and settings). Logs, warnings and progress bars
go to stderr. A bad setting, a model that cannot be loaded or any other error ends with exit status 2
and one line on stderr (SDSAT_TRACEBACK=1 adds the traceback); Ctrl-C ends with 130 and "interrupted". \
Training and the benchmark have their own entry points: `python -m sdsat.train` and
`python -m sdsat.bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import types
from dataclasses import asdict, replace
from typing import Callable, TextIO

log = logging.getLogger("sdsat.cli")

EXIT_BAD_SETTINGS = 2  # as argparse and `python -m sdsat.bench` use for bad arguments
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: the line says what to fix, --help the rest."""

    def error(self, message: str):
        self.exit(EXIT_BAD_SETTINGS, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .decoding import MAX_TREE_CANDIDATES, METHODS, SCHEMES, DecodeConfig

    parser = _Parser(prog="python -m sdsat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate one completion and print it with its statistics",
                              description="Generate one completion with SDSAT or vanilla decoding.")
    what = gen.add_argument_group("request")
    what.add_argument("--prompt", required=True, metavar="TEXT",
                      help="required: the text to continue, or with --chat the user message")
    what.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the model's chat template (default off: plain completion)")
    what.add_argument("--method", default="sdsat", choices=METHODS, help="decoder (default sdsat)")
    what.add_argument("--k", type=int, help="adaptive tokens (drafts) per SDSAT step, 1..the SATs' largest k "
                      f"(default: auto's choice; {DecodeConfig.k} with another scheme, or that largest k if smaller)")
    what.add_argument("--scheme", default="auto", choices=("auto", *SCHEMES),
                      help="SDSAT: auto (the scheme, k, lookup and tree predicted fastest on this machine from its "
                           "measured pass costs; --k, --lookup and --tree override its choices), two_step (the "
                           "paper: draft pass, then verify pass) or fused (verify and draft the next block in one "
                           "pass); default auto")
    what.add_argument("--adaptive-k", action="store_true",
                      help="SDSAT two_step: adapt k to recent acceptance, up to --k (default off: k fixed)")
    what.add_argument("--lookup", type=int, metavar="N",
                      help="SDSAT two_step: when the last tokens occurred before in the prompt or output, verify up "
                           "to N tokens copied from there (prompt lookup) instead of SAT drafts; "
                           "0..64, default: auto's choice, else 0 (off)")
    what.add_argument("--tree", type=int, metavar="N",
                      help="SDSAT two_step, greedy: also verify N of the SATs' runner-up candidates in each verify "
                           f"pass (a draft tree); 0..{MAX_TREE_CANDIDATES}, default: auto's choice, else 0 (the chain)")
    what.add_argument("--max-new-tokens", type=int, default=DecodeConfig.max_new_tokens,
                      metavar="N", help=f"stop after N new tokens (default {DecodeConfig.max_new_tokens})")
    what.add_argument("--stop", action="append", default=[], metavar="STR",
                      help="stop once the output contains STR (repeatable); the output ends with it (default: none)")
    sampling = gen.add_argument_group("sampling (greedy unless --sample or --temperature is given)")
    sampling.add_argument("--sample", action="store_true",
                          help="sample instead of greedy decoding, at temperature 1 (default off: greedy)")
    sampling.add_argument("--temperature", type=float, metavar="T",
                          help="sample with temperature T > 0; implies --sample (default 1.0 when sampling)")
    sampling.add_argument("--top-p", type=float, metavar="P",
                          help="nucleus: keep the likeliest tokens up to probability mass P in (0, 1] (default 1: all)")
    sampling.add_argument("--top-k", type=int, metavar="N", help="keep the N most likely tokens (default 0: all)")
    sampling.add_argument("--seed", type=int, metavar="N",
                          help="seed of the sampler, for repeatable samples (default: a fresh seed per run)")
    _model_arguments(gen)
    out = gen.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object instead of text and statistics (default off)")
    out.add_argument("--verbose", action="store_true",
                     help="show library logs and progress bars on stderr (default off)")
    tune = commands.add_parser("tune", help="measure this machine for auto and print the cost curve and the plan",
                               description="Measure what a forward pass costs on this machine, per precision and "
                                           "kernel form, and print it with the plan auto takes from it. The "
                                           "measurement is kept (~/.cache/sdsat/tuning.json) and read by every "
                                           "later start; without --force, what is kept is shown, not measured again.")
    tune.add_argument("--force", action="store_true",
                      help="measure again and replace what is kept, also a clean measurement (default off)")
    _model_arguments(tune)
    tune.add_argument("--json", action="store_true", help="print the tuning as one JSON object (default off)")
    tune.add_argument("--verbose", action="store_true", help="show library logs on stderr (default off)")
    return parser


def _model_arguments(command: argparse.ArgumentParser) -> None:
    from .models import DEFAULT_MODEL

    model = command.add_argument_group("model")
    model.add_argument("--model", default=DEFAULT_MODEL,
                       metavar="ID_OR_DIR", help=f"hub id or local folder (default: the embedded {DEFAULT_MODEL})")
    sats = model.add_mutually_exclusive_group()
    sats.add_argument("--sat-ids", type=int, nargs="+", metavar="ID",
                      help="the paper's kind of SATs: these vocabulary ids (one id may serve every position, "
                           "e.g. 32011 for the CodeLlama-SDSAT checkpoints; default: the model's own SATs, the shipped "
                           "adapter for the default model, else an untrained adapter)")
    sats.add_argument("--adapter", metavar="DIR",
                      help="a SAT adapter folder (adapter_config.json + weights; default as for --sat-ids)")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="weights' dtype (default auto: float32 on a CPU; on a GPU a known checkpoint's own, "
                            "else bfloat16)")
    model.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                       help="where the model runs (default auto: cuda if available, else mps, else cpu)")
    model.add_argument("--quantization", choices=["4bit", "8bit"],
                       help="bitsandbytes loading, CUDA only (default: none)")
    model.add_argument("--no-cpu-kernels", action="store_true",
                       help="on a CPU, multiply with nn.Linear as is, not with the fastest "
                       "measured kernel per row count (cpu_kernels.py; default off: routed)")
    model.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice; on a busy "
                       "machine 1 can be much faster)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="run the model repository's own Python code, only for repositories you trust (default off)")


def main(argv: list[str] | None = None) -> int:
    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)  # imports torch: seconds in which Ctrl-C is likely
    _quiet_libraries(args.verbose)
    out = sys.stdout
    # Whatever a library prints goes to stderr: stdout is for the result alone.
    with contextlib.redirect_stdout(sys.stderr):
        return _tune(args, out) if args.command == "tune" else _generate(args, out)


def guarded(entry: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a command-line entry point so that it ends in one line on stderr, never a traceback.

    The contract of every `python -m sdsat...` command: a ValueError (bad settings, ModelLoadError) is its
    message; any other error is its type and message (with SDSAT_TRACEBACK=1 the traceback too), both
    exit status 2; Ctrl-C at any moment, start-up included, prints "interrupted" and exits 130.
    """
    with _noting_ctrl_c() as ctrl_c:
        try:
            return entry(argv)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as err:  # the boundary with the user: a traceback is not an answer they can act on
            # transformers' lazy imports can turn a Ctrl-C into a ModuleNotFoundError, with or without the
            # KeyboardInterrupt among its causes (an import it broke fails again later)
            if ctrl_c.seen or _interrupted(err):
                print("\ninterrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            return _report(err)


def _report(err: Exception) -> int:
    if isinstance(err, ValueError):
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    if os.environ.get("SDSAT_TRACEBACK"):
        import traceback

        traceback.print_exc()
    print(f"error: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
    return EXIT_BAD_SETTINGS


@contextlib.contextmanager
def _noting_ctrl_c():
    """Note a Ctrl-C (then interrupt as Python does), so that an error it caused still reads as "interrupted".
    Leaves alone a SIGINT that is ignored, or handled by someone else, or a thread that is not the main one."""
    ctrl_c = types.SimpleNamespace(seen=False)

    def note(signum, frame):
        ctrl_c.seen = True
        raise KeyboardInterrupt

    ours = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, note)
    try:
        yield ctrl_c
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(err: BaseException) -> bool:
    """Whether a KeyboardInterrupt lies anywhere in the chain of causes of `err`."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def one_line(err: BaseException) -> str:
    """An error's message on one line (some libraries' messages span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def decode_config(args: argparse.Namespace, max_k: int | None = None):
    """The DecodeConfig the arguments ask for; raises ValueError on a bad combination.

    Without `max_k` (the model is not loaded yet) k is not checked; everything else is.
    """
    from .decoding import DecodeConfig
    from .sampling import SamplingConfig

    do_sample = args.sample or args.temperature is not None
    if not do_sample and (args.top_p is not None or args.top_k is not None):
        raise ValueError("--top-p and --top-k only apply when sampling: add --sample or --temperature")
    sampling = SamplingConfig(do_sample=do_sample,
                              temperature=1.0 if args.temperature is None else args.temperature,
                              top_p=1.0 if args.top_p is None else args.top_p,
                              top_k=0 if args.top_k is None else args.top_k, seed=args.seed)
    k = args.k if args.k is not None else min(DecodeConfig.k, max_k or DecodeConfig.k)
    config = DecodeConfig(method=args.method, k=k, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          stop_strings=list(args.stop), adaptive_k=args.adaptive_k,
                          scheme="two_step" if args.scheme == "auto" else args.scheme,
                          lookup_tokens=args.lookup or 0, tree_candidates=args.tree or 0)
    if max_k is None:
        replace(config, method="vanilla").validate()
    else:
        config.validate(max_k=max_k)
    return config


def _generate(args: argparse.Namespace, out: TextIO) -> int:
    from .decoding import GenerationResult

    if not args.prompt:
        raise ValueError("prompt must be a non-empty string")
    decode_config(args)  # refuse bad settings before spending seconds on loading the model
    held = _HeldLogs()  # load-time warnings are shown only if the request goes ahead
    with held:
        engine = _load_engine(args)
        config = decode_config(args, max_k=engine.max_k)
        # The tuning kept for this machine (vanilla too then decodes in the precision and form SDSAT would); none
        # is measured here: without one, the model's fallback form and auto's fallback settings.
        measured = engine.use_stored_tuning()
        if args.scheme == "auto" and config.method == "sdsat":
            if not measured:
                log.warning("this machine has not been measured yet: auto uses its fallback settings; `python -m "
                            "sdsat tune` measures it once (a minute or a few) for the fastest settings")
            given = {"k": args.k, "lookup_tokens": args.lookup, "tree_candidates": args.tree}
            config = engine.auto_config(config, explicit={n for n, value in given.items() if value is not None},
                                        chat=args.chat)
            config.validate(max_k=engine.max_k)
        prompt_ids = engine.encode(args.prompt, chat=args.chat)
        events = engine.stream(prompt_ids, config)  # checks the prompt against the model's context
    held.release()
    text = _StreamedText(engine.tokenizer, out if not args.json else None)
    for event in events:
        if isinstance(event, GenerationResult):
            result = event
        else:
            text.add(event.tokens)
    text.finish(result.text)
    if args.json:
        payload = result.to_dict() | {"model": engine.name, "sat_kind": engine.sat_model.spec.kind,
                                      "sat_trained": engine.sat_trained, "chat": args.chat,
                                      "settings": asdict(config)}
        if engine.tuning is not None:
            payload["auto"] = engine.tuning.to_dict()
        out.write(json.dumps(payload) + "\n")
    else:
        out.write("\n" + format_stats(result, engine.sat_trained) + "\n")
    out.flush()
    return 0


def _load_engine(args: argparse.Namespace):
    """The engine a command's model arguments name, its CPU kernels routed only with a plan kept on disk."""
    from .engine import Engine, SatSource
    from .models import LoadConfig

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    return Engine.load(LoadConfig(model=args.model, dtype=args.dtype, device=args.device,
                                  quantization=args.quantization, trust_remote_code=args.trust_remote_code,
                                  cpu_kernels=not args.no_cpu_kernels, measure_kernels=False),
                       SatSource(sat_ids=args.sat_ids, adapter=args.adapter))


def _tune(args: argparse.Namespace, out: TextIO) -> int:
    engine = _load_engine(args)
    logging.getLogger("sdsat.tuning").setLevel(logging.INFO)  # each measurement step, with the time left
    tuning = engine.tune(remeasure="all" if args.force else "missing")
    out.write((json.dumps(tuning.to_dict()) if args.json else format_tuning(tuning)) + "\n")
    out.flush()
    return 0


def format_tuning(tuning) -> str:
    """The cost curve per precision (ms per pass, and as multiples of the one-token pass) and auto's plan."""
    from .hardware import cpu_name

    lines = [f"machine: {cpu_name()}, {_threads()} torch threads"]
    for precision, curve in tuning.curves.items():
        one = curve.one_token_s
        widths = " ".join(f"{w}:{curve.plain[w] / one:.2f}" for w in sorted(curve.plain) if w > 1)
        drafts = " ".join(f"{k}:{t / one:.2f}" for k, t in sorted(curve.draft.items()))
        fused = " ".join(f"{k}:{t / one:.2f}" for k, t in sorted(curve.fused.items()))
        noisy = " (measured under load)" if tuning.noisy.get(precision) else ""
        lines += [f"{tuning.names[precision]}: {1e3 * one:.1f} ms per one-token pass{noisy}",
                  f"  plain block of N tokens, x one-token pass: {widths}",
                  f"  draft pass [t, SAT x k], x one-token pass: {drafts or '-'}",
                  f"  fused pass at k, x one-token pass: {fused or '-'}",
                  f"  rows alone vs batched: {'bit-equal' if tuning.rows[precision].invariant else 'differ'} "
                  f"({tuning.rows[precision].rows} rows)"]
    lines += [f"{name}: {1e3 * s:.1f} ms per one-token pass (vanilla only)" for name, s in tuning.vanilla_s.items()]
    lines.append(f"fastest vanilla: {tuning.baseline[0]}")
    lines.append(f"auto: {tuning.plan.reason}" if tuning.plan else f"auto: {tuning.note}")
    return "\n".join(lines)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def format_stats(result, sat_trained: bool = True) -> str:
    """The result's metrics as a few human-readable lines (the definitions of SDSAT.md)."""
    method = f"sdsat (k={result.k})" if result.method == "sdsat" else result.method
    lines = [
        "-" * 60,
        f"{method}: {len(result.token_ids)} new tokens in {result.seconds:.2f} s "
        f"({result.tokens_per_second:.1f} tokens/s), stopped by {result.stop_reason}",
        f"forward passes: {result.forward_passes} ({result.tokens_per_forward_pass:.2f} new tokens per pass), "
        f"iterations: {len(result.steps)}",
    ]
    if result.method == "sdsat":
        positions = " ".join(f"{i}:{rate:.2f}" for i, rate in enumerate(result.acceptance_by_position, 1))
        lines += [f"mean accepted length: {result.mean_tokens_per_iteration:.2f} tokens per iteration "
                  f"(the verified and bonus tokens counted), {result.mean_accepted_drafts:.2f} accepted drafts",
                  f"acceptance by draft position: {positions}"]
        copied = sum(step.draft_source == "lookup" for step in result.steps)
        if copied:
            at_once = sum(step.kind == "lookup_direct" for step in result.steps)
            lines.append(f"prompt lookup: {copied} of {len(result.steps)} iterations verified copied tokens instead "
                         f"of SAT drafts ({at_once} of them without a draft pass; the lines above count both)")
        branched = [step for step in result.steps if step.kind == "tree"]
        if branched:
            taken = sum(any(step.draft_ranks[:step.accepted]) for step in branched)
            most = max(step.candidates for step in branched)  # fewer runner-ups fit when adaptive k is small
            lines.append(f"draft tree: up to {most} candidates per verify pass; {taken} of {len(branched)} "
                         "iterations accepted a SAT's runner-up")
        if not sat_trained:
            lines.append("note: these SATs are an untrained adapter, so drafts are rarely accepted")
    return "\n".join(lines)


class _StreamedText:
    """Writes the decoded text as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out: TextIO | None):
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.shown = ""

    def add(self, tokens: list[int]) -> None:
        self.tokens += tokens
        if self.out is None:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def finish(self, final: str) -> None:
        if self.out is None:
            return
        # Decoding more tokens can, rarely, re-space earlier text: then write the final text afresh.
        self.out.write(final[len(self.shown):] if final.startswith(self.shown) else "\n" + final)
        self.out.write("\n")


class _HeldLogs:
    """Holds log records and Python warnings back until `release`, so an error is the only line shown."""

    def __init__(self):
        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append

    def __enter__(self):
        root = logging.getLogger()
        self.saved = root.handlers[:]
        root.handlers = [self.handler]
        logging.captureWarnings(True)
        return self

    def __exit__(self, *exc):
        logging.getLogger().handlers = self.saved
        return False

    def release(self) -> None:
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        self.records.clear()


def _quiet_libraries(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
