"""Ctrl-C while a command starts: one line on stderr and exit status 130, at any instant.

By default Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. While a command
starts, that is often inside a C++ library that called back into Python (importing torch, building its
operator registry, loading a model): a KeyboardInterrupt raised there can become a C++ exception that
nothing catches, and the process aborts ("terminate called after throwing an instance of
'pybind11::error_already_set'", exit -6) instead of ending with a line. So during start-up SIGINT does not
raise: its handler writes the line and ends the process at once, without unwinding through C++ frames.
Nothing is lost by that: start-up writes nothing that is not written whole or not at all (`jsonfile`, the
model cache's temporary folder, which the next start removes).

The package takes SIGINT over only in a process started as one of the project's commands, `python -m sdsat`
or `python app.py` (`take_over_if_a_command`, called when the package is first imported, before the imports
that take seconds), and keeps it for the whole run: a decode stopped by Ctrl-C ends the same way, after the
text streamed so far. A program that imports sdsat as a library, a test run, `python -m sdsat.bench` (which
keeps its completed runs on Ctrl-C) and `python -m sdsat.train` keep Python's KeyboardInterrupt.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path

EXIT_INTERRUPTED = 130
LINE = b"\ninterrupted\n"


def _exit_now(signum, frame) -> None:
    try:
        sys.stdout.flush()
    except Exception:  # a stream closed or mid-write: the line below still goes out
        pass
    os.write(2, LINE)
    os._exit(EXIT_INTERRUPTED)


def exit_on_ctrl_c() -> bool:
    """From now on, Ctrl-C ends the process with one line and 130. Call it first thing, before the imports
    that take seconds. Leaves alone a SIGINT that is ignored or handled by someone else, and threads other than
    the main one (which cannot set handlers); returns whether it took over."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _exit_now)
    atexit.register(_ignore_once_finished)
    return True


def _ignore_once_finished() -> None:
    """At interpreter exit the command's work is done. Python's finalization puts a handler it installed back
    to the default, under which a late Ctrl-C would kill the process (exit -2) instead of letting it end; an
    ignored signal it leaves alone."""
    if signal.getsignal(signal.SIGINT) is _exit_now:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def raise_on_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt again, as Python's default does (only where `exit_on_ctrl_c` took over)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _exit_now:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def started_as_a_command(argv: list[str], orig_argv: list[str], app: Path) -> bool:
    """Whether a process whose `sys.argv` / `sys.orig_argv` are these runs `python -m sdsat` or `python app.py`
    (`app`: the project's app.py)."""
    if "-m" in orig_argv[1:]:
        after = orig_argv.index("-m", 1) + 1
        return after < len(orig_argv) and orig_argv[after] == "sdsat"
    return bool(argv) and argv[0].endswith("app.py") and Path(argv[0]).resolve() == app.resolve()


def take_over_if_a_command() -> bool:
    """`exit_on_ctrl_c` in a process started as `python -m sdsat` or `python app.py`; returns whether it did."""
    app = Path(__file__).resolve().parent.parent / "app.py"
    if started_as_a_command(sys.argv, getattr(sys, "orig_argv", []), app):
        return exit_on_ctrl_c()
    return False
