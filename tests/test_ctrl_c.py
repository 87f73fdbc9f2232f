"""Ctrl-C at any instant of start-up, of `python -m sdsat generate` and of `python app.py`: one line,
"interrupted", and exit status 130; never a traceback, never an abort (sdsat/interrupt.py says why one was
possible). Real subprocesses, each sent SIGINT at one instant; a bounded number of instants per command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdsat import interrupt

ROOT = Path(__file__).resolve().parent.parent
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# After the process runs the project's first line (see `_wait_until_running`): instants spread over importing
# torch and gradio, loading the model, warming it up and, for the CLI, decoding (seconds on 2 cores).
INSTANTS = (0.0, 0.05, 0.2, 0.5, 1.0, 1.7, 2.6, 4.0, 6.0)
COMMANDS = {"cli": [sys.executable, "-m", "sdsat", "generate", "--prompt", "def fib(n):", "--max-new-tokens", "8"],
            "app": [sys.executable, "app.py"]}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_running(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the child has loaded a compiled module from site-packages: by then it has run the project's first
    line (both commands import sdsat before any library). Before that the interpreter itself is starting, where
    no Python program can catch a signal."""
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "site-packages" in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.005)
    raise AssertionError("the child never got past the interpreter's start")


def _interrupted_at(command: str, instant: float) -> tuple[int, str]:
    env = ENV | {"GRADIO_SERVER_PORT": str(_free_port()), "GRADIO_SERVER_NAME": "127.0.0.1"}
    proc = subprocess.Popen(COMMANDS[command], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_until_running(proc)
        time.sleep(instant)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the child start")
@pytest.mark.parametrize("command", ["cli", "app"])
def test_ctrl_c_at_any_instant_of_start_up_is_one_line_and_130(command):
    outcomes = []
    for instant in INSTANTS:
        code, err = _interrupted_at(command, instant)
        if code == 0 and command == "cli":
            break  # the generation finished before the signal: start-up is over
        lines = [line for line in err.splitlines() if line.strip()]
        outcomes.append((instant, code, lines[-3:]))
        assert "Traceback" not in err and "terminate called" not in err, (instant, err[-2000:])
        assert code == interrupt.EXIT_INTERRUPTED and lines[-1:] == ["interrupted"], (instant, code, err[-2000:])
        # one line of ours: whatever the libraries logged before it, nothing follows it
        assert err.rstrip().endswith("\ninterrupted") or err.strip() == "interrupted", (instant, err[-500:])
    assert len(outcomes) >= 4, outcomes  # most instants fell inside start-up


def test_only_the_projects_commands_take_ctrl_c_over(tmp_path):
    app = ROOT / "app.py"
    python = sys.executable
    assert interrupt.started_as_a_command(["-m"], [python, "-m", "sdsat", "generate"], app)
    assert interrupt.started_as_a_command(["-m"], [python, "-X", "importtime", "-m", "sdsat", "tune"], app)
    assert interrupt.started_as_a_command([str(app)], [python, "app.py"], app)
    assert not interrupt.started_as_a_command(["-m"], [python, "-m", "sdsat.bench"], app)  # keeps its runs
    assert not interrupt.started_as_a_command(["-m"], [python, "-m", "pytest", "tests"], app)
    assert not interrupt.started_as_a_command([str(tmp_path / "app.py")], [python, "app.py"], app)  # another app
    assert not interrupt.started_as_a_command(["-c"], [python, "-c", "import sdsat"], app)
    # In this process (pytest) importing sdsat left Python's KeyboardInterrupt in place.
    assert signal.getsignal(signal.SIGINT) is not interrupt._exit_now
