"""The same request decoded where the CLI decodes it and where the server does, as tokens/s and their ratio.

    python -m sdsat.bench.threads                      # the page's default race, 3 rounds
    python -m sdsat.bench.threads --prompt "def fib(n):" --max-new-tokens 128 --rounds 5

Each place runs in a fresh process, so that one place's threads never slow the other's (compute.py says why
they would), and the places take turns, round after round:
  cli       the main thread loads and decodes (what `python -m sdsat generate` does);
  server    the page's /generate path: the engine cache loads on the compute thread, and a race decodes there;
  threaded  the main thread loads, a new thread per request decodes: the server before the compute thread.
A place prints one JSON line: vanilla's and SDSAT's tokens/s over its decodes. The table gives each place's
medians and their ratio to the CLI's; `server` should be about 1.0 and `threaded` shows the cost it avoids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading

from ..hardware import cpu_name

PLACES = ("cli", "server", "threaded")
DEFAULT_PROMPT = "def count_vowels(word):\n    count = 0\n"  # the page's first example


def _request(prompt: str, max_new_tokens: int) -> dict:
    from ..models import DEFAULT_MODEL

    return dict(prompt=prompt, model=DEFAULT_MODEL, chat=False, mode="greedy", max_new_tokens=max_new_tokens,
                temperature=1.0, top_p=1.0, top_k=0, seed=0)


def _decode_configs(engine, inputs: dict):
    """vanilla's and auto's SDSAT DecodeConfig for the request, as the page would build them."""
    from ..ui.presets import auto_settings
    from ..ui.settings import Limits, parse_request

    limits = Limits(max_new_tokens=inputs["max_new_tokens"])
    request = parse_request(limits, inputs | auto_settings(engine.tuning, True, engine.max_k))
    request.validate(limits, engine.max_k)
    return request.decode_config("vanilla"), request.decode_config("sdsat")


def _speeds(run_one, repeats: int) -> dict:
    speeds: dict[str, list[float]] = {"vanilla": [], "sdsat": []}
    run_one()  # warm-up
    for _ in range(repeats):
        for method, tokens_per_second in run_one().items():
            speeds[method].append(tokens_per_second)
    return {m: statistics.median(v) for m, v in speeds.items()}


def _place(place: str, inputs: dict, repeats: int) -> dict:
    """One place's median tokens/s per decoder (run in its own process)."""
    from ..decoding import collect

    if place == "server":
        from ..ui.handlers import Page
        from ..ui.settings import Limits

        page = Page(Limits(max_new_tokens=inputs["max_new_tokens"]))
        page.cache.get(inputs["model"])  # loads, settles auto's plan and warms up, on the compute thread
        settings = page.auto_values(inputs["model"], inputs["mode"])

        def run_one() -> dict:
            out = page.generate_sync(inputs | settings)
            return {m: out[m]["tokens_per_second"] for m in ("vanilla", "sdsat")}
        return _speeds(run_one, repeats)

    from ..engine import Engine

    engine = Engine.load()
    engine.use_stored_tuning()
    configs = dict(zip(("vanilla", "sdsat"), _decode_configs(engine, inputs)))
    ids = engine.encode(inputs["prompt"])

    def decode(config) -> float:
        return collect(engine.stream(ids, config)).tokens_per_second

    def in_new_thread(config) -> float:
        out: list[float] = []
        worker = threading.Thread(target=lambda: out.append(decode(config)))
        worker.start()
        worker.join()
        return out[0]

    run = decode if place == "cli" else in_new_thread
    return _speeds(lambda: {m: run(c) for m, c in configs.items()}, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="processes per place, taking turns (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="decodes per process after a warm-up (default 3)")
    parser.add_argument("--places", nargs="+", choices=PLACES, default=list(PLACES))
    parser.add_argument("--place", choices=PLACES, help=argparse.SUPPRESS)  # a child process's own place
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    inputs = _request(args.prompt, args.max_new_tokens)
    if args.place:
        print(json.dumps(_place(args.place, inputs, args.repeats)), flush=True)
        return 0

    runs: dict[str, list[dict]] = {p: [] for p in args.places}
    for round_ in range(args.rounds):
        for place in args.places:
            child = subprocess.run([sys.executable, "-m", "sdsat.bench.threads", "--place", place,
                                    "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
                                    "--repeats", str(args.repeats)],
                                   capture_output=True, text=True, env=os.environ | {"PYTHONWARNINGS": "ignore"})
            if child.returncode != 0:
                sys.stderr.write(child.stderr)
                return child.returncode
            runs[place].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}, {place}: " + ", ".join(f"{m} {v:.1f} tokens/s"
                                                              for m, v in runs[place][-1].items()), file=sys.stderr)
    print(f"machine: {cpu_name()}; {args.rounds} rounds of {args.repeats} decodes per place, "
          f"{args.max_new_tokens} new tokens")
    median = {p: {m: statistics.median(r[m] for r in rs) for m in ("vanilla", "sdsat")} for p, rs in runs.items()}
    base = median.get("cli")
    print(f"{'place':<10} {'vanilla tok/s':>14} {'sdsat tok/s':>12} {'sdsat/vanilla':>14}"
          + (f" {'vanilla/cli':>12} {'sdsat/cli':>10}" if base else ""))
    for place, m in median.items():
        line = f"{place:<10} {m['vanilla']:>14.1f} {m['sdsat']:>12.1f} {m['sdsat'] / m['vanilla']:>14.2f}"
        if base:
            line += f" {m['vanilla'] / base['vanilla']:>12.2f} {m['sdsat'] / base['sdsat']:>10.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
