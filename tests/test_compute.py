"""The compute thread: one thread for a server's torch work, so libgomp keeps one pool of workers that spin.

The decisive test runs the real app in a fresh process, as `python app.py` does, and counts how often the
process's threads went to sleep per forward pass of a /generate request: libgomp's throttled wait (what a
second pool of workers brings) sleeps at nearly every parallel region, hundreds of times a pass. The same
count is taken where the main thread loads and a new thread decodes (the server before the compute thread),
so the test asserts the path the decode takes, not a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sdsat.compute import THREAD_NAME, ComputeThread

ROOT = Path(__file__).resolve().parent.parent


def test_jobs_run_on_the_one_thread_in_order_and_results_come_back():
    compute = ComputeThread()
    names = [compute.run(lambda: threading.current_thread().name) for _ in range(3)]
    assert names == [THREAD_NAME] * 3
    assert compute.run(lambda: compute.run(lambda: compute.on_it))  # nested: inline, no deadlock
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: "still serving") == "still serving"


def test_urgent_jobs_go_first_and_a_long_job_serves_them_between_its_steps():
    compute, order = ComputeThread(), []
    gate, started = threading.Event(), threading.Event()

    def long_job():
        started.set()
        gate.wait(10)
        order.append("step 1")
        order.append(("served", compute.serve_urgent()))
        order.append("step 2")

    first = compute.submit(long_job)
    started.wait(10)
    normal = compute.submit(order.append, "normal")
    urgent = compute.submit(order.append, "urgent", urgent=True)
    assert compute.busy
    gate.set()
    for future in (first, normal, urgent):
        future.result(10)
    assert order == ["step 1", "urgent", ("served", 1), "step 2", "normal"]
    assert compute.serve_urgent() == 0  # from another thread: nothing to serve here
    deadline = time.monotonic() + 5
    while compute.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_compute_thread():
    from sdsat import compute

    compute.compute_thread().run(lambda: None)  # the parent's thread is running
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread does not exist here, a fresh one must serve
        try:
            os.write(write, compute.compute_thread().run(lambda: threading.current_thread().name).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 100).decode() == THREAD_NAME


# Run in a fresh process: /generate as the app serves it (app.py's start-up and launch, then the handler), or the
# same request decoded on a new thread after the main thread loaded the model. Prints sleeps per forward pass,
# and for the app the most wake-ups per second of any one of its threads while it serves nobody.
_PLACE = r"""
import json, os, resource, sys, threading, time
PLACE = sys.argv[1]

def sleeps():  # voluntary context switches of every thread the process had, ended ones included
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw

def sleeps_per_thread():
    counts = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as status:
            counts[tid] = int(status.read().split("voluntary_ctxt_switches:")[1].split()[0])
    return counts

INPUTS = dict(prompt="def add(a, b):\n", model="", chat=False, mode="greedy", k=3, max_new_tokens=24,
              temperature=1.0, top_p=1.0, top_k=0, seed=0, lookup_tokens=0, tree_candidates=0)
if PLACE == "app":
    import app
    from sdsat.ui.registry import EngineCache
    EngineCache._tune_behind = lambda *args, **kwargs: None  # no measuring of the machine beside the decodes
    app.page.preload()  # what `python app.py` does before it serves
    app.demo.launch(**(app.LAUNCH_OPTIONS | dict(prevent_thread_lock=True, server_port=int(os.environ["PORT"]))))
    app.page.generate_sync(INPUTS)  # warm
    before = sleeps()
    out = app.page.generate_sync(INPUTS)
    passes = out["vanilla"]["forward_passes"] + out["sdsat"]["forward_passes"]
    per_pass = (sleeps() - before) / passes
    idle = sleeps_per_thread()
    time.sleep(2)
    idle = {tid: n - idle.get(tid, 0) for tid, n in sleeps_per_thread().items()}
    print(json.dumps({"sleeps_per_pass": per_pass, "idle_most_per_s": max(idle.values()) / 2}), flush=True)
    os._exit(0)  # the server's threads need no orderly shutdown here
else:
    from sdsat.decoding import DecodeConfig, collect
    from sdsat.engine import Engine
    engine = Engine.load()
    engine.use_stored_tuning()
    ids = engine.encode(INPUTS["prompt"])
    configs = [DecodeConfig(method="vanilla", max_new_tokens=24), DecodeConfig(method="sdsat", k=3, max_new_tokens=24)]
    def both():
        results = []
        worker = threading.Thread(target=lambda: results.extend(collect(engine.stream(ids, c)) for c in configs))
        worker.start()
        worker.join()
        return results
    both()  # warm
    before = sleeps()
    passes = sum(r.forward_passes for r in both())
print(json.dumps({"sleeps_per_pass": (sleeps() - before) / passes}))
"""


def _run_place(place: str) -> dict:
    from test_space import free_port

    # two threads whatever the test run's share: the throttled wait needs a pool of OpenMP workers
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2",
                        "PORT": str(free_port()), "GRADIO_ANALYTICS_ENABLED": "False"}
    done = subprocess.run([sys.executable, "-c", _PLACE, place], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def served():
    """What the app's process did: sleeps per pass of a /generate decode, and idle wake-ups once served."""
    return _run_place("app")


@pytest.mark.skipif(sys.platform != "linux", reason="libgomp and its throttled wait are Linux's")
def test_the_server_decodes_where_libgomp_workers_spin(served):
    threaded = _run_place("threaded")["sleeps_per_pass"]
    if threaded < 20:
        pytest.skip(f"this OpenMP runtime does not throttle a second pool ({threaded:.1f} sleeps per pass)")
    served = served["sleeps_per_pass"]
    assert served < threaded / 5, f"the app's decode sleeps {served:.1f} times a pass (a second pool: {threaded:.1f})"


_EXIT_WHILE_BUSY = r"""
import sys, torch
from sdsat.compute import compute_thread

def decode_like():  # torch work until the process exits, as a decode checks its should_stop per iteration
    x = torch.ones(1 << 18)
    while not compute_thread().stopping:
        x.add_(1)

def measure_like():  # a long job that pauses between rounds, as the tuning does
    x = torch.ones(1 << 18)
    while True:
        compute_thread().serve_urgent()
        x.add_(1)

compute_thread().submit(measure_like if sys.argv[1] == "measure" else decode_like)
compute_thread().submit(print, "a queued job never runs")
import time; time.sleep(0.5)
print("main thread done", flush=True)
"""


@pytest.mark.parametrize("job", ["decode", "measure"])
def test_the_process_exits_cleanly_while_the_compute_thread_works(job):
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BUSY, job], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "main thread done\n" and "terminate called" not in done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_served_page_does_not_poll_while_idle(served):
    """Gradio's queue polls for work every millisecond unless app.py slows it (events.calm_queue); each wake-up
    takes a core from the decoder's OpenMP workers."""
    most = served["idle_most_per_s"]
    assert most < 150, f"a thread of the idle server woke {most:.0f} times a second"
