"""The same request decoded where the CLI decodes it and where the server does, as tokens/s and their ratio.

    python -m sdsat.bench.threads                      # the page's default race, 3 rounds
    python -m sdsat.bench.threads --prompt "def fib(n):" --max-new-tokens 128 --rounds 5
    python -m sdsat.bench.threads --chat --prompt "Give me a simple recipe for pancakes."

Each place runs in a fresh process, so that one place's threads never slow the other's (compute.py says why
they would), and the places take turns, round after round:
  cli       the main thread loads and decodes (what `python -m sdsat generate` does);
  server    the page's /generate path in process: the engine cache loads on the compute thread, a race decodes there;
  http      `python app.py` on a free local port, called through gradio_client: /generate, /race and /chat;
  threaded  the main thread loads, a new thread per request decodes: the server before the compute thread.
A place prints one JSON line: vanilla's and SDSAT's tokens/s over its decodes (/generate's; `chat sdsat` is
a chat turn of the same prompt, SDSAT alone; `http` adds /race's two). The table gives each place's medians and
their ratio to the CLI's; `server` and `http` should be about 1.0, and `threaded` shows the cost avoided.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading

from .. import ASSETS
from ..hardware import cpu_name

PLACES = ("cli", "server", "http", "threaded")
DEFAULT_PROMPT = "def count_vowels(word):\n    count = 0\n"  # the page's first example


def _request(prompt: str, max_new_tokens: int, chat: bool = False) -> dict:
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


def _speeds(run_one, repeats: int) -> dict:
    speeds: dict[str, list[float]] = {}
    run_one()  # warm-up
    for _ in range(repeats):
        for method, tokens_per_second in run_one().items():
            speeds.setdefault(method, []).append(tokens_per_second)
    return {m: statistics.median(v) for m, v in speeds.items()}


def _wait_until_serving(url: str, app: subprocess.Popen, log, limit_s: float = 600) -> None:
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


def _over_http(inputs: dict, repeats: int) -> dict:
    """/generate, /race and /chat of a real `python app.py`, through gradio_client."""
    import tempfile

    from gradio_client import Client

    from ..ui.handlers import RACE_INPUTS
    from ..planner import FALLBACK

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryFile("w+") as log:
        app = subprocess.Popen([sys.executable, "app.py"], cwd=ASSETS.parent, stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"GRADIO_SERVER_PORT": str(port), "SDSAT_QUIET_WAIT_S": "0",
                                                 "SDSAT_MAX_NEW_TOKENS": str(inputs["max_new_tokens"])})
        try:
            _wait_until_serving(url, app, log)
            client = Client(url, verbose=False)
            probe = client.predict(**inputs, **FALLBACK, api_name="/generate")  # says auto's plan here
            plan = (probe.get("auto") or {}).get("plan") or {"settings": FALLBACK}
            request = inputs | {n: plan["settings"][n] for n in FALLBACK}

            def run_one() -> dict:
                out = client.predict(**request, api_name="/generate")
                race_in = request | {"show_rejected": False}
                race_out = client.predict(*[race_in[n] for n in RACE_INPUTS], api_name="/race")[-1]  # run_data
                chat = client.predict(message=inputs["prompt"], history=[], **{
                    n: v for n, v in request.items() if n not in ("prompt", "chat")}, api_name="/chat")
                return {"vanilla": out["vanilla"]["tokens_per_second"], "sdsat": out["sdsat"]["tokens_per_second"],
                        "chat sdsat": chat["sdsat"]["tokens_per_second"],
                        "race vanilla": race_out["vanilla"]["tokens_per_second"],
                        "race sdsat": race_out["sdsat"]["tokens_per_second"]}
            return _speeds(run_one, repeats)
        finally:
            app.terminate()
            app.wait(timeout=60)


def _place(place: str, inputs: dict, repeats: int) -> dict:
    """One place's median tokens/s per decoder (run in its own process)."""
    from ..decoding import collect

    if place == "http":
        return _over_http(inputs, repeats)
    if place == "server":
        from ..ui.handlers import Page
        from ..ui.settings import Limits

        # quiet_wait_s 0: a tuning kept from a busy spell is not measured again beside the decodes timed here
        page = Page(Limits(max_new_tokens=inputs["max_new_tokens"], quiet_wait_s=0))
        engine = page.cache.get(inputs["model"])  # loads, settles auto's plan and warms up, on the compute thread
        if engine.measuring is not None:
            raise SystemExit("this machine has no kept tuning: run `python -m sdsat tune` first")
        settings = page.auto_values(inputs["model"], inputs["mode"])

        def run_one() -> dict:
            out = page.generate_sync(inputs | settings)
            return {m: out[m]["tokens_per_second"] for m in ("vanilla", "sdsat")}
        return _speeds(run_one, repeats)

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
    return _speeds(run_one, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true",
                        help="/generate, /race and the CLI's decodes put the prompt in the chat template, as a Chat "
                             "turn does (default off: the text continued as it is)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per place, taking turns (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="decodes per process after a warm-up (default 3)")
    parser.add_argument("--places", nargs="+", choices=PLACES, default=list(PLACES))
    parser.add_argument("--place", choices=PLACES, help=argparse.SUPPRESS)  # a child process's own place
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    inputs = _request(args.prompt, args.max_new_tokens, args.chat)
    if args.place:
        print(json.dumps(_place(args.place, inputs, args.repeats)), flush=True)
        return 0

    runs: dict[str, list[dict]] = {p: [] for p in args.places}
    for round_ in range(args.rounds):
        for place in args.places:
            child = subprocess.run([sys.executable, "-m", "sdsat.bench.threads", "--place", place,
                                    "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
                                    "--repeats", str(args.repeats), *(["--chat"] if args.chat else [])],
                                   capture_output=True, text=True, env=os.environ | {"PYTHONWARNINGS": "ignore"})
            if child.returncode != 0:
                sys.stderr.write(child.stderr)
                return child.returncode
            runs[place].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}, {place}: " + ", ".join(f"{m} {v:.1f} tokens/s"
                                                              for m, v in runs[place][-1].items()), file=sys.stderr)
    print(f"machine: {cpu_name()}; {args.rounds} rounds of {args.repeats} decodes per place, "
          f"{args.max_new_tokens} new tokens" + (", in the chat template" if args.chat else ""))
    median = {p: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for p, rs in runs.items()}
    base = median.get("cli")
    columns = list(dict.fromkeys(m for ms in median.values() for m in ms))
    print("tokens/s (and × the CLI's same decode)")
    print(f"{'place':<10}" + "".join(f"{c:>22}" for c in columns))
    for place, ms in median.items():
        cells = []
        for column in columns:
            value = ms.get(column)
            same = base and base.get(column.removeprefix("race "))
            cells.append("-" if value is None else f"{value:.1f}" + (f" ({value / same:.2f}×)" if same else ""))
        print(f"{place:<10}" + "".join(f"{c:>22}" for c in cells))
    for place, ms in median.items():
        print(f"{place}: sdsat ÷ vanilla {ms['sdsat'] / ms['vanilla']:.2f}"
              + (f", race {ms['race sdsat'] / ms['race vanilla']:.2f}" if "race sdsat" in ms else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
