"""This machine's pass costs as `python -m sdsat tune` measures them and as the page's start-up does, side by side.

    python -m sdsat.bench.tuning_places               # 2 rounds
    python -m sdsat.bench.tuning_places --rounds 3

Each round measures twice, each time from an empty cache folder with the default model's weights linked in:
once by the CLI (`python -m sdsat tune`, on the main thread), once by `python app.py`, which measures behind
the page on its compute thread while it serves nobody. The order alternates between rounds. The table gives
each precision's forms: the one-token pass in ms (medians over rounds) per place, and the page's ÷ the CLI's.
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

PLACES = ("cli", "app")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.tuning_places", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="measurements per place, taking turns (default 2)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in PLACES}
    with tempfile.TemporaryDirectory(prefix="sdsat-tuning-places-") as root:
        for round_ in range(args.rounds):
            for place in PLACES if round_ % 2 == 0 else reversed(PLACES):
                cache = _fresh_cache(Path(root) / f"{place}-{round_}")
                (_measure_by_cli if place == "cli" else _measure_by_app)(cache)
                costs, noisy = one_token_costs(cache)
                runs[place].append(costs)
                line = ", ".join(f"{form} {s * 1e3:.1f} ms" for form, s in costs.items())
                load = f" (kept under load: {', '.join(noisy)})" if noisy else ""
                print(f"round {round_ + 1}, {place}: {line}{load}", file=sys.stderr, flush=True)
    print(f"machine: {cpu_name()}; {args.rounds} rounds, each place from an empty cache")
    print(f"{'precision, form':<36}{'CLI ms':>9}{'page ms':>9}{'page ÷ CLI':>12}   per round")
    for form in runs["cli"][0]:
        cli = [r[form] for r in runs["cli"] if form in r]
        app = [r[form] for r in runs["app"] if form in r]
        if not cli or not app:
            continue
        rounds = " ".join(f"{a / c:.2f}" for a, c in zip(app, cli))
        print(f"{form:<36}{statistics.median(cli) * 1e3:>9.1f}{statistics.median(app) * 1e3:>9.1f}"
              f"{statistics.median(app) / statistics.median(cli):>12.2f}   {rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
