"""Does the thread a pass runs on change its cost? The one-token pass of each bfloat16 form, on the main thread
(as `python -m sdsat tune` measures) and on the compute thread (as the page's start-up does):

    python scripts/pass_by_thread.py --rounds 8
    python scripts/pass_by_thread.py --rounds 8 --imports pandas --import-in main   # what an import does

Each place is a process of its own, kept for the whole run (two places in one process would give libgomp two
pools, docs/architecture.md "One compute thread"); the places take turns, round by round, and the table gives
the median of the per-round ratios compute ÷ main. Each form is a model of its own, loaded once per place.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMS = ("row-invariant keyed", "row-invariant per-row", "routed")  # tuning's names
PLACES = ("main", "compute")
READY = "ready"


def _serve(place: str, steps: int, imports: list[str]) -> None:
    """A child's loop: one round of timings, as a JSON line, for every line its parent writes."""
    import importlib

    import torch

    for module in imports:  # before the models load, as a served app has imported gradio by then
        importlib.import_module(module)

    from sdsat import tuning
    from sdsat.compute import compute_thread
    from sdsat.engine import Engine
    from sdsat.models import LoadConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compile_trial import one_token_s

    def load() -> dict:
        models = {}
        for form in FORMS:
            engine = Engine.load(LoadConfig(device="cpu"))
            tuning.set_precision(engine.sat_model, "bfloat16", kernels=True, form=form)
            models[form] = engine.sat_model.model
        return models

    run = (lambda job: job()) if place == "main" else (lambda job: compute_thread().submit(job).result())
    models = run(load)
    context = torch.randint(100, 20000, (1, 256), generator=torch.Generator().manual_seed(0))
    run(lambda: [one_token_s(model, context, 4) for model in models.values()])  # warm-up
    print(READY, flush=True)
    for _ in sys.stdin:
        print(json.dumps(run(lambda: {f: one_token_s(m, context, steps) * 1e3 for f, m in models.items()})),
              flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed passes per form and round (default 20)")
    parser.add_argument("--imports", nargs="+", default=[], metavar="MODULE",
                        help="modules one place imports first (with --import-in), e.g. gradio or pandas")
    parser.add_argument("--import-in", choices=PLACES, help="the place that imports --imports")
    parser.add_argument("--place", choices=PLACES, help=argparse.SUPPRESS)  # a child's own place
    args = parser.parse_args(argv)
    if args.place:
        _serve(args.place, args.steps, args.imports)
        return 0
    if args.imports and not args.import_in:
        parser.error("--imports needs --import-in main or compute")
    from sdsat.hardware import cpu_name

    def command(place: str) -> list[str]:
        imports = ["--imports", *args.imports] if place == args.import_in else []
        return [sys.executable, __file__, "--place", place, "--steps", str(args.steps), *imports]

    children = {p: subprocess.Popen(command(p), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for p in PLACES}
    try:
        for child in children.values():
            while child.stdout.readline().strip() != READY:
                if child.poll() is not None:
                    raise SystemExit(f"a place exited with code {child.returncode}")
        times: dict[str, list[dict]] = {p: [] for p in PLACES}
        for round_ in range(args.rounds):
            for place in PLACES if round_ % 2 == 0 else PLACES[::-1]:
                children[place].stdin.write("go\n")
                children[place].stdin.flush()
                times[place].append(json.loads(children[place].stdout.readline()))
            print(f"round {round_ + 1}: " + "; ".join(
                f"{p} " + ", ".join(f"{t[-1][f]:.1f}" for f in FORMS) for p, t in times.items()), file=sys.stderr)
    finally:
        for child in children.values():
            child.kill()
            child.wait()
    print(f"machine: {cpu_name()}; bfloat16, one-token pass behind 256 tokens, {args.rounds} rounds in turns"
          + (f"; {args.import_in} imported {', '.join(args.imports)}" if args.imports else ""))
    print(f"{'form':<24}{'main ms':>9}{'compute ms':>12}{'compute ÷ main':>16}")
    for form in FORMS:
        main_ms = statistics.median(r[form] for r in times["main"])
        compute_ms = statistics.median(r[form] for r in times["compute"])
        ratio = statistics.median(c[form] / m[form] for c, m in zip(times["compute"], times["main"]))
        print(f"{form:<24}{main_ms:>9.1f}{compute_ms:>12.1f}{ratio:>16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
