"""Small JSON caches on disk (kernel plans, tunings): read as one object, written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_object(path: Path | None) -> dict | None:
    """The JSON object stored at `path`: {} when there is no file, None when it is not a JSON object."""
    if path is None or not path.is_file():
        return {}
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def write_object(path: Path, data: dict, indent: int | None = None) -> None:
    """Write `data` to a temporary file, flush it to the disk and rename it over `path`: a reader (another
    process, or this one after a crash or a power cut) sees the old object or the new one, never half of one.
    Temporary files left by writers that died midway are removed first. A read-only cache is skipped."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)
        with open(tmp, "w") as out:
            out.write(json.dumps(data, indent=indent))
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)
    except OSError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale(path: Path) -> None:
    """Delete <stem>.tmp<pid> files beside `path` whose process is gone, or is this one (a process killed
    during a save leaves one; a later process may reuse its id)."""
    for tmp in path.parent.glob(f"{path.stem}.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
