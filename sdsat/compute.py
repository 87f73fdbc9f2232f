"""One thread for all of a server's torch work.

torch's CPU builds run parallel regions on libgomp, which keeps a pool of worker threads for every thread that
starts one. While the process holds more of those threads than it has CPUs, libgomp's workers wait for the next
region by sleeping instead of spinning (its "throttled" wait), and a decode makes hundreds of short regions per
forward pass: each then pays for waking a worker. A server whose main thread loaded the model and whose worker
threads decode holds two pools, and decoded at about half speed on 2 cores (docs/architecture.md, "One compute
thread"). So a server runs every model load, warm-up, measurement and decode on this one thread: the process
keeps one pool, and its workers spin.

The thread is one per process, as libgomp's pools are; a forked child (ZeroGPU's GPU workers) starts its own.
Requests are urgent: a long job here (measuring the machine) calls `serve_urgent` between its measurements, so
a visitor's decode runs there at full speed instead of beside it.

At interpreter exit the thread stops before Python finalizes: queued jobs are dropped, a decode stops at its
next iteration (`stopping`), and a long job at its next `serve_urgent` (ComputeStopped). A daemon thread caught
inside torch at finalization is ended by pthread_exit through C++ frames, which aborts the process
("terminate called without an active exception").
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")
THREAD_NAME = "sdsat-compute"


class ComputeStopped(Exception):
    """The process is exiting: a long job on the compute thread ends at its next pause."""


class ComputeThread:
    """A single daemon thread that runs jobs in order, urgent ones (requests) first."""

    def __init__(self, name: str = THREAD_NAME):
        self.name = name
        self._urgent: collections.deque = collections.deque()
        self._normal: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._running = 0  # jobs started and not finished (nested ones count too)
        self._thread: threading.Thread | None = None
        self.stopping = False  # the interpreter is exiting: jobs end at their next pause

    @property
    def on_it(self) -> bool:
        """Whether the calling thread is this one."""
        return self._thread is not None and threading.current_thread() is self._thread

    @property
    def busy(self) -> bool:
        """A job is running or waiting."""
        with self._ready:
            return bool(self._running or self._urgent or self._normal)

    def submit(self, fn: Callable[..., T], *args, urgent: bool = False, **kwargs) -> "Future[T]":
        """Queue `fn(*args, **kwargs)`; its Future holds the result or the exception. Called from this thread,
        the job runs after the current one, as any other."""
        future: Future = Future()
        with self._ready:
            self._start()
            (self._urgent if urgent else self._normal).append((future, fn, args, kwargs))
            self._ready.notify()
        return future

    def run(self, fn: Callable[..., T], *args, urgent: bool = False, **kwargs) -> T:
        """`fn(*args, **kwargs)` on this thread, waiting for it; inline when called from this thread."""
        if self.on_it:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, urgent=urgent, **kwargs).result()

    def serve_urgent(self) -> int:
        """Run the urgent jobs waiting now, when called from this thread (a long job's pause); how many ran.
        Raises ComputeStopped there once the process is exiting."""
        if not self.on_it:
            return 0
        if self.stopping:
            raise ComputeStopped("the process is exiting")
        served = 0
        while True:
            with self._ready:
                if not self._urgent:
                    return served
                job = self._urgent.popleft()
            self._execute(*job)
            served += 1

    def stop(self) -> None:
        """Drop the queued jobs and let the running one end at its next pause; the thread then ends."""
        with self._ready:
            self.stopping = True
            dropped = [*self._urgent, *self._normal]
            self._urgent.clear()
            self._normal.clear()
            self._ready.notify_all()
        for future, *_ in dropped:
            future.cancel()

    def _start(self) -> None:
        if self.stopping:
            raise ComputeStopped("the process is exiting")
        if self._thread is None or not self._thread.is_alive():
            # Not a daemon: the interpreter's exit waits for it, after `stop` (threading's own exit hook,
            # which runs before that wait; concurrent.futures stops its workers the same way).
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=False)
            threading._register_atexit(self.stop)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._urgent or self._normal or self.stopping)
                if self.stopping:
                    return
                job = (self._urgent or self._normal).popleft()
            self._execute(*job)

    def _execute(self, future: Future, fn, args, kwargs) -> None:
        if not future.set_running_or_notify_cancel():
            return
        with self._ready:
            self._running += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:  # handed to whoever waits on the future
            future.set_exception(err)
        else:
            future.set_result(result)
        finally:
            with self._ready:
                self._running -= 1


_THREAD = ComputeThread()


def compute_thread() -> ComputeThread:
    """This process's compute thread (started by its first job)."""
    return _THREAD


def _after_fork_in_child() -> None:
    global _THREAD
    _THREAD = ComputeThread()  # the parent's thread does not exist here


os.register_at_fork(after_in_child=_after_fork_in_child)
