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
    """Write `data` to a temporary file and rename it over `path`: a reader (another process, or this one
    after a crash) sees the old object or the new one, never half of one. A read-only cache is skipped."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=indent))
        tmp.replace(path)
    except OSError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
