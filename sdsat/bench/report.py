"""The results payload (what `--json` holds) and writing it safely, also while a run is going on."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .prompts import BenchPrompt
from .stats import summarize

FORMAT_VERSION = 1


def build_payload(meta: dict, prompts: list[BenchPrompt], runs: list[dict], interrupted: bool = False,
                  complete: bool = False, pass_at_1: dict | None = None) -> dict:
    """Everything about a run: how it was measured, the prompts, the summary and every run.

    `complete` is False while the run is going on (the file is rewritten after each prompt).
    """
    done = {r["prompt_index"] for r in runs}
    return {
        "format_version": FORMAT_VERSION,
        "meta": meta,
        "complete": complete,
        "interrupted": interrupted,
        "prompts": [p.to_dict() | {"completed": p.index in done} for p in prompts],
        "summary": summarize(runs) if runs else {"variants": [], "greedy_mismatches": [], "all_greedy_identical": True},
        "pass_at_1": pass_at_1,
        "runs": runs,
    }


def _finite(value):
    """JSON has no NaN / infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(payload: dict, path: str | Path) -> Path:
    """Write atomically (temporary file, then rename), so an interrupted write never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(_dumps(_finite(payload)), encoding="utf-8")
    tmp.replace(path)
    return path


def _dumps(payload: dict) -> str:
    """Indented JSON, except that each run (long lists of token ids) takes one line."""
    if "runs" not in payload:
        return json.dumps(payload, indent=1, ensure_ascii=False) + "\n"
    runs = payload["runs"]
    head = json.dumps({k: v for k, v in payload.items() if k != "runs"}, indent=1, ensure_ascii=False)
    body = ",\n".join(json.dumps(r, ensure_ascii=False) for r in runs)
    return f'{head[:-2]},\n "runs": [\n{body}\n ]\n}}\n'


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))
