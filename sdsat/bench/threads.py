"""The same request decoded where the CLI decodes it and where the server does, as tokens/s and their ratio.

    python -m sdsat.bench.threads                      # the page's default race, 6 rounds
    python -m sdsat.bench.threads --prompt "def fib(n):" --max-new-tokens 128 --rounds 8
    python -m sdsat.bench.threads --chat --prompt "Give me a simple recipe for pancakes."

Each place is one process of its own, started once and kept, so that one place's threads never slow the
other's (compute.py says why they would); the places then take turns decode by decode, round after round, and
each round's tokens/s are divided by the CLI's of the same round. A slow spell of the machine that lasts
minutes so falls on both sides of a ratio alike.
  cli       the main thread loads and decodes (what `python -m sdsat generate` does);
  server    the page's /generate path in process: the engine cache loads on the compute thread, a race decodes there;
  http      `python app.py` on a free local port, called through gradio_client: /generate, /race and /chat;
  threaded  the main thread loads, a new thread per request decodes: the server before the compute thread.
A round gives vanilla's and SDSAT's tokens/s per place (/generate's; `chat sdsat` is a chat turn of the same
prompt, SDSAT alone; `http` adds /race's two). The table gives each place's medians and the median of its
per-round ratios to the CLI; `server` and `http` should be about 1.0, and `threaded` shows the cost avoided.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

from .. import ASSETS
from ..hardware import cpu_name

PLACES = ("cli", "server", "http", "threaded")
READY = "ready"  # a child place says it has loaded and warmed up
DEFAULT_PROMPT = "def count_vowels(word):\n    count = 0\n"  # the page's first example


def request_for(prompt: str, max_new_tokens: int, chat: bool = False) -> dict:
    """A greedy request of the default model, by the page's input names (auto's settings are added per place)."""
    from ..models import DEFAULT_MODEL

    return dict(prompt=prompt, model=DEFAULT_MODEL, chat=chat, mode="greedy", max_new_tokens=max_new_tokens,
                temperature=1.0, top_p=1.0, top_k=0, seed=0)


def _decode_configs(engine, inputs: dict):
    """vanilla's and auto's SDSAT DecodeConfig for the request, as the page would build them."""
    from ..ui.presets import auto_settings
    from ..ui.settings import Limits, parse_request

    limits = Limits(max_new_tokens=inputs["max_new_tokens"])
    request = parse_request(limits, inputs | auto_settings(engine.tuning, True, engine.max_k))
    request.validate(limits, engine.max_k)
    return request.decode_config("vanilla"), request.decode_config("sdsat")


def wait_until_serving(url: str, app: subprocess.Popen, log, limit_s: float = 600) -> None:
    """Until `app` answers at `url`; raises with the end of its log if it exits or takes longer."""
    import time
    import urllib.request

    deadline = time.monotonic() + limit_s
    while True:
        if app.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(f"app.py did not serve {url}:\n{log.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            time.sleep(1)


def free_port() -> int:
    """A local TCP port free now, for an `app.py` started by a benchmark."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def served_app(inputs: dict) -> Iterator[tuple[subprocess.Popen, object, dict]]:
    """A real `python app.py` on a free local port: (its process, a gradio_client Client, `inputs` with auto's
    settings there), after one /generate call that asks auto's plan and warms the server up."""
    import tempfile

    from gradio_client import Client

    from ..planner import FALLBACK

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryFile("w+") as log:
        app = subprocess.Popen([sys.executable, "app.py"], cwd=ASSETS.parent, stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"GRADIO_SERVER_PORT": str(port), "SDSAT_QUIET_WAIT_S": "0",
                                                 "SDSAT_MAX_NEW_TOKENS": str(inputs["max_new_tokens"])})
        try:
            wait_until_serving(url, app, log)
            client = Client(url, verbose=False)
            probe = client.predict(**inputs, **FALLBACK, api_name="/generate")  # says auto's plan here
            plan = (probe.get("auto") or {}).get("plan") or {"settings": FALLBACK}
            yield app, client, inputs | {n: plan["settings"][n] for n in FALLBACK}
        finally:
            app.terminate()
            app.wait(timeout=60)


def race_inputs(request: dict) -> list:
    """/race's positional inputs for a /generate request."""
    from ..ui.handlers import RACE_INPUTS

    return [(request | {"show_rejected": False})[n] for n in RACE_INPUTS]


@contextlib.contextmanager
def _over_http(inputs: dict) -> Iterator[Callable[[], dict]]:
    """One round's decodes by /generate, /race and /chat of a real `python app.py`, through gradio_client."""
    with served_app(inputs) as (_, client, request):
        def run_one() -> dict:
            out = client.predict(**request, api_name="/generate")
            race_out = client.predict(*race_inputs(request), api_name="/race")[-1]  # run_data
            chat = client.predict(message=inputs["prompt"], history=[], **{
                n: v for n, v in request.items() if n not in ("prompt", "chat")}, api_name="/chat")
            return {"vanilla": out["vanilla"]["tokens_per_second"], "sdsat": out["sdsat"]["tokens_per_second"],
                    "chat sdsat": chat["sdsat"]["tokens_per_second"],
                    "race vanilla": race_out["vanilla"]["tokens_per_second"],
                    "race sdsat": race_out["sdsat"]["tokens_per_second"]}
        run_one()  # warm-up
        yield run_one


def _place(place: str, inputs: dict) -> Callable[[], dict]:
    """One round's decodes of an in-process place: its tokens/s per decoder."""
    from ..decoding import collect

    if place == "server":
        from ..ui.handlers import Page
        from ..ui.settings import Limits

        # quiet_wait_s 0: a tuning kept from a busy spell is not measured again beside the decodes timed here
        page = Page(Limits(max_new_tokens=inputs["max_new_tokens"], quiet_wait_s=0))
        engine = page.cache.get(inputs["model"])  # loads, settles auto's plan and warms up, on the compute thread
        if engine.measuring is not None:
            raise SystemExit("this machine has no kept tuning: run `python -m sdsat tune` first")
        settings = page.auto_values(inputs["model"], inputs["mode"])

        def run_page() -> dict:
            out = page.generate_sync(inputs | settings)
            return {m: out[m]["tokens_per_second"] for m in ("vanilla", "sdsat")}
        return run_page

    from ..engine import Engine

    engine = Engine.load()
    engine.use_stored_tuning()
    vanilla, sdsat = _decode_configs(engine, inputs)
    ids = engine.encode(inputs["prompt"], chat=inputs["chat"])
    jobs = {"vanilla": (ids, vanilla), "sdsat": (ids, sdsat)}
    if not inputs["chat"]:  # with --chat, SDSAT's decode is the chat turn's already
        jobs["chat sdsat"] = (engine.encode(inputs["prompt"], chat=True), sdsat)

    def decode(ids, config) -> float:
        return collect(engine.stream(ids, config)).tokens_per_second

    def in_new_thread(ids, config) -> float:
        out: list[float] = []
        worker = threading.Thread(target=lambda: out.append(decode(ids, config)))
        worker.start()
        worker.join()
        return out[0]

    run = decode if place == "cli" else in_new_thread

    def run_one() -> dict:
        speeds = {name: run(*job) for name, job in jobs.items()}
        return speeds | ({"chat sdsat": speeds["sdsat"]} if inputs["chat"] else {})
    return run_one


def _serve_place(place: str, inputs: dict) -> None:
    """A child process's loop: one round's decodes, as a JSON line, for every line its parent writes."""
    run_one = _place(place, inputs)
    run_one()  # warm-up
    print(READY, flush=True)
    for _ in sys.stdin:
        print(json.dumps(run_one()), flush=True)


@contextlib.contextmanager
def _child(place: str, args: argparse.Namespace) -> Iterator[Callable[[], dict]]:
    """A place in a process of its own, kept for the whole run; calling it runs one round there."""
    child = subprocess.Popen([sys.executable, "-m", "sdsat.bench.threads", "--place", place,
                              "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
                              *(["--chat"] if args.chat else [])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=os.environ | {"PYTHONWARNINGS": "ignore"})

    def answer() -> str:
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the {place} place exited with code {child.wait()}")
        return line.strip()

    try:
        while answer() != READY:
            pass

        def run_one() -> dict:
            child.stdin.write("go\n")
            child.stdin.flush()
            return json.loads(answer())
        yield run_one
    finally:
        child.kill()
        child.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true",
                        help="/generate, /race and the CLI's decodes put the prompt in the chat template, as a Chat "
                             "turn does (default off: the text continued as it is)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of decodes, the places in turns (default 6)")
    parser.add_argument("--places", nargs="+", choices=PLACES, default=list(PLACES))
    parser.add_argument("--place", choices=PLACES, help=argparse.SUPPRESS)  # a child process's own place
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    inputs = request_for(args.prompt, args.max_new_tokens, args.chat)
    if args.place:
        _serve_place(args.place, inputs)
        return 0

    runs: dict[str, list[dict]] = {p: [] for p in args.places}
    with contextlib.ExitStack() as stack:
        places = {p: stack.enter_context(_over_http(inputs) if p == "http" else _child(p, args)) for p in args.places}
        for round_ in range(args.rounds):
            for place, run_one in places.items():
                runs[place].append(run_one())
                print(f"round {round_ + 1}, {place}: " + ", ".join(f"{m} {v:.1f} tokens/s"
                                                                  for m, v in runs[place][-1].items()), file=sys.stderr)
    print(f"machine: {cpu_name()}; {args.rounds} rounds, the places in turns, {args.max_new_tokens} new tokens"
          + (", in the chat template" if args.chat else ""))
    print(_table(runs))
    return 0


def _table(runs: dict[str, list[dict]]) -> str:
    """Median tokens/s per place and decoder, and the median of its per-round ratios to the CLI's same decode."""
    median = {p: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for p, rs in runs.items()}
    columns = list(dict.fromkeys(m for ms in median.values() for m in ms))
    lines = ["tokens/s (and the median of the per-round ratios to the CLI's same decode)",
             f"{'place':<10}" + "".join(f"{c:>22}" for c in columns)]
    for place, ms in median.items():
        cells = []
        for column in columns:
            value = ms.get(column)
            same = column.removeprefix("race ")
            ratio = (statistics.median(r[column] / c[same] for r, c in zip(runs[place], runs["cli"]))
                     if "cli" in runs and same in runs["cli"][0] and value is not None else None)
            cells.append("-" if value is None else f"{value:.1f}" + (f" ({ratio:.2f}×)" if ratio else ""))
        lines.append(f"{place:<10}" + "".join(f"{c:>22}" for c in cells))
    for place, rs in runs.items():
        lines.append(f"{place}: sdsat ÷ vanilla {statistics.median(r['sdsat'] / r['vanilla'] for r in rs):.2f}"
                     + (f", race {statistics.median(r['race sdsat'] / r['race vanilla'] for r in rs):.2f}"
                        if "race sdsat" in rs[0] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
