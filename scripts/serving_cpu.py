"""What a served page takes from its decoder: the CPU of `app.py`'s threads while /race or /generate decodes.

    python scripts/serving_cpu.py --calls 4                    # /race, then /generate, the page's first example
    python scripts/serving_cpu.py --endpoint race --calls 6 --prompt "def fib(n):"

Starts `python app.py` on a free local port, calls it through gradio_client, and reads every thread's CPU time
from /proc every 0.25 s. Only the intervals in which the busiest thread (the compute thread, or its OpenMP
worker) was busy for most of the interval count: that is, while a decoder ran, not while a finished race's
plots were drawn. On a 2-core machine the decoder's two threads want both cores, so what the other threads use
in those intervals (the event loop streaming snapshots, the pool threads) is taken from the decoder. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdsat.bench.threads import DEFAULT_PROMPT, race_inputs, request_for, served_app  # noqa: E402
from sdsat.hardware import cpu_name  # noqa: E402

POLL_S = 0.25
BUSY = 0.8  # the busiest thread's share of an interval that makes it a decoding interval


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of `pid`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class Sampler:
    """Per-thread CPU of `pid`, summed over the intervals in which one thread was busy (a decoder ran)."""

    def __init__(self, pid: int):
        self.pid, self.seconds, self.used = pid, 0.0, collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        before, start = thread_cpu(self.pid), time.monotonic()
        while not self._stop.wait(POLL_S):
            now, end = thread_cpu(self.pid), time.monotonic()
            used = {tid: now[tid] - before.get(tid, 0.0) for tid in now}
            if used and max(used.values()) > BUSY * (end - start):
                self.seconds += end - start
                self.used.update(used)
            before, start = now, end

    def shares(self) -> list[float]:
        """Each thread's share of a core over the decoding intervals, busiest first."""
        return sorted((used / self.seconds for used in self.used.values()), reverse=True) if self.seconds else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=4, help="calls per endpoint (default 4)")
    parser.add_argument("--endpoint", choices=("race", "generate"), nargs="+", default=["race", "generate"])
    args = parser.parse_args(argv)

    with served_app(request_for(args.prompt, args.max_new_tokens)) as (app, client, request):
        race = race_inputs(request)
        client.predict(*race, api_name="/race")
        print(f"machine: {cpu_name()}; {args.calls} calls each, {args.max_new_tokens} new tokens")
        for endpoint in args.endpoint:
            speeds = []
            with Sampler(app.pid) as sampler:
                for _ in range(args.calls):
                    out = (client.predict(*race, api_name="/race")[-1] if endpoint == "race" else
                           client.predict(**request, api_name="/generate"))
                    speeds.append(f"{out['vanilla']['tokens_per_second']:.1f}/{out['sdsat']['tokens_per_second']:.1f}")
            shares = sampler.shares()
            print(f"/{endpoint}: tokens/s vanilla/SDSAT {', '.join(speeds)}; {sampler.seconds:.1f} s decoding")
            print(f"  the two busiest threads {', '.join(f'{s:.1%}' for s in shares[:2])} of a core; "
                  f"all others {sum(shares[2:]):.1%} (largest {', '.join(f'{s:.1%}' for s in shares[2:5])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
