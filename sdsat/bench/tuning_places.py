"""This machine's pass costs as `python -m sdsat tune` measures them and as the page's start-up does, side by side.

    python -m sdsat.bench.tuning_places               # 2 rounds
    python -m sdsat.bench.tuning_places --rounds 3
    python -m sdsat.bench.tuning_places --rounds 3 --places cold cli twin   # what decoding first changes

Each round measures once per place, each time from an empty cache folder with the default model's weights
linked in: by the CLI (`python -m sdsat tune`, on the main thread), and by `python app.py`, which measures
behind the page on its compute thread while it serves nobody. Two more places take the page's steps apart,
each a process of its own on its main thread: `twin` (the page's sequence: a first engine in its fallback form
decodes a few tokens, then a second copy of the model is tuned) and `cold` (the model tuned right after it
loads, with no decode first: the CLI before its tuning warmed up). The order turns between rounds. The table
gives each precision's forms: the one-token pass in ms (medians over rounds) per place, and each place's ÷ the
first place's (the median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import ASSETS
from ..hardware import cpu_name
from .threads import free_port

PLACES = ("cli", "app", "twin", "cold")


def _fresh_cache(folder: Path) -> Path:
    from ..models import DEFAULT_MODEL, default_model_folder

    folder.mkdir(parents=True)
    (folder / DEFAULT_MODEL).symlink_to(default_model_folder(), target_is_directory=True)
    return folder


def _tuning_file(cache: Path) -> Path:
    from ..tuning import TUNING_FILE

    return cache / TUNING_FILE


def _measure_by_cli(cache: Path) -> None:
    subprocess.run([sys.executable, "-m", "sdsat", "tune"], check=True, capture_output=True, cwd=ASSETS.parent,
                   env=os.environ | {"SDSAT_CACHE": str(cache)})


def _measure_in_sequence(place: str, cache: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sdsat.bench.tuning_places", "--tune-as", place], text=True,
                          capture_output=True, cwd=ASSETS.parent, env=os.environ | {"SDSAT_CACHE": str(cache)})
    if done.returncode != 0:
        raise RuntimeError(f"the {place} tuning exited with code {done.returncode}:\n{done.stderr[-2000:]}")


def _tune_as(place: str) -> None:
    """A child's tuning, in the page's sequence (`twin`) or with no decode before it (`cold`)."""
    from ..engine import Engine
    from ..models import LoadConfig

    engine = Engine.load(LoadConfig(measure_kernels=False))
    if place == "twin":
        engine.use_stored_tuning()  # none: the fallback form, as the page's first engine
        engine.warm_up()
        engine.twin().tune()
    else:
        engine._warm_up_to_measure = lambda: None  # the CLI's tuning as it was: no decode before it measures
        engine.tune()


def _measure_by_app(cache: Path, limit_s: float = 1800) -> None:
    """Start `python app.py` on a free port and stop it once its tuning is kept and its plan logged."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        app = subprocess.Popen([sys.executable, "app.py"], cwd=ASSETS.parent, stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"SDSAT_CACHE": str(cache), "GRADIO_SERVER_PORT": str(port)})
        try:
            deadline = time.monotonic() + limit_s
            while True:
                time.sleep(2)
                log.seek(0)
                if "sdsat.tuning: auto:" in log.read() and _tuning_file(cache).exists():
                    return
                if app.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"app.py kept no tuning:\n{log.read()[-2000:]}")
        finally:
            app.terminate()
            app.wait(timeout=60)


def one_token_costs(cache: Path) -> tuple[dict[str, float], list[str]]:
    """('precision form' -> seconds per one-token pass, the precisions whose kept run was measured under load),
    from a cache's tuning file."""
    from ..tuning import _Measured

    costs, noisy = {}, []
    for entry in json.loads(_tuning_file(cache).read_text()).values():
        measured = _Measured.from_dict(entry)
        dtype = measured.curve.dtype
        costs[f"{dtype} {measured.form}"] = measured.curve.one_token_s
        costs |= {f"{dtype} {form}": seconds for form, seconds in measured.others_s.items()}
        if measured.noisy:
            noisy.append(str(dtype))
    return costs, noisy


def _table(runs: dict[str, list[dict[str, float]]]) -> str:
    """ms per place (medians over rounds), and each place's per-round ratios to the first place's."""
    first, *others = runs
    lines = [f"{'precision, form':<36}" + "".join(f"{p + ' ms':>10}" for p in runs)
             + "".join(f"{p + ' ÷ ' + first:>14}   per round" for p in others)]
    for form in runs[first][0]:
        if not all(form in r for rs in runs.values() for r in rs):
            continue
        cells = "".join(f"{statistics.median(r[form] for r in rs) * 1e3:>10.1f}" for rs in runs.values())
        for place in others:
            ratios = [a[form] / b[form] for a, b in zip(runs[place], runs[first])]
            cells += f"{statistics.median(ratios):>14.2f}   " + " ".join(f"{r:.2f}" for r in ratios)
        lines.append(f"{form:<36}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.tuning_places", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="measurements per place, taking turns (default 2)")
    parser.add_argument("--places", nargs="+", choices=PLACES, default=["cli", "app"],
                        help="where to measure (default: cli app); the first is the one the others are divided by")
    parser.add_argument("--tune-as", choices=("twin", "cold"), help=argparse.SUPPRESS)  # a child's own place
    args = parser.parse_args(argv)
    if args.tune_as:
        _tune_as(args.tune_as)
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    places = list(dict.fromkeys(args.places))
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in places}
    with tempfile.TemporaryDirectory(prefix="sdsat-tuning-places-") as root:
        for round_ in range(args.rounds):
            for place in places[round_ % len(places):] + places[:round_ % len(places)]:
                cache = _fresh_cache(Path(root) / f"{place}-{round_}")
                if place in ("cli", "app"):
                    (_measure_by_cli if place == "cli" else _measure_by_app)(cache)
                else:
                    _measure_in_sequence(place, cache)
                costs, noisy = one_token_costs(cache)
                runs[place].append(costs)
                line = ", ".join(f"{form} {s * 1e3:.1f} ms" for form, s in costs.items())
                load = f" (kept under load: {', '.join(noisy)})" if noisy else ""
                print(f"round {round_ + 1}, {place}: {line}{load}", file=sys.stderr, flush=True)
    print(f"machine: {cpu_name()}; {args.rounds} rounds, each place from an empty cache")
    print(_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
