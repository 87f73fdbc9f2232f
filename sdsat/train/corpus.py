"""A self-distillation corpus at scale: the base model's own completions of prompts drawn from this machine.

`python -m sdsat.train.corpus --out runs/corpus` builds it in shards, in the background, over as many
runs as it takes: each shard is a fixed slice of a fixed prompt list, generated in left-padded batches
and written atomically, so a stopped build resumes at the first missing shard and gives the same files
as an uninterrupted one (sampling is seeded per batch). Shipped as this recipe, not as data.

Prompts (all offline, from what the machine holds):
  * code: function and method signatures with their docstrings, class heads and module heads, from the
    standard library and every installed package (HumanEval's shape: continue the code);
  * chat: instructions from templates, and instructions made from those docstrings ("Write a Python
    function `name(args)` that ..."), answered through the model's chat template;
  * the page's own example prompts.
Each batch is decoded greedily or sampled at one of the temperatures the page offers (`MODES`), in turn;
`--modes greedy` keeps a build to greedy text, which teaches the SATs most per token.
HumanEval never enters: a prompt or completion that overlaps it is dropped (`HumanEvalFilter`: its entry
points, its distinctive lines). Nor does any prompt of the benchmark's prompt files (`held_out_texts`:
the prompts themselves, as written).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import logging
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from .. import ASSETS
from ..models import DEFAULT_MODEL, LoadConfig, load_model
from ..prompts import encode_prompt
from .data import HumanEvalFilter, chat_instructions
from .instructions import take_turns, varied_instructions
from .precision import resolve_batched_dtype

log = logging.getLogger(__name__)

# (name, temperature, top_p): temperature 0 is greedy. The page's sampling defaults and the benchmark's.
MODES = (("greedy", 0.0, 1.0), ("t0.7", 0.7, 0.95), ("t1.0", 1.0, 1.0))
MODE_NAMES = tuple(name for name, _, _ in MODES)
INSTRUCTIONS = ("templates", "varied")  # CorpusRecipe.instructions
PROMPTS_FILE, MANIFEST_FILE = "prompts.jsonl.gz", "corpus.json"
HELD_OUT_PROMPTS = ASSETS / "prompts"  # every *.jsonl here is a benchmark suite: none of it is trained on


@dataclass
class CorpusRecipe:
    """How the corpus is made; stored beside it, and a resumed build must use the same one."""

    model: str = DEFAULT_MODEL  # the base model whose completions are collected
    out: str = "runs/corpus"  # folder of prompts, shards and manifest
    seed: int = 0  # orders the prompts and seeds the sampled batches
    shard_prompts: int = 128  # prompts per shard (one file)
    batch_size: int = 32  # completions generated at once
    max_new_tokens: int = 192  # new tokens per completion
    max_prompt_tokens: int = 256  # longer prompts are left out (their prefill would cost more than their completion)
    chat_share: float = 0.4  # share of chat prompts in the interleaved list
    # the chat instructions besides those made from docstrings: "templates" (10 tasks over 34 topics, the
    # first builds') or "varied" (instructions.py: everyday and technical topics, writing, code in several
    # languages, the shell's commands and the installed software)
    instructions: str = "templates"
    dtype: str = "auto"  # precision of the generation (the corpus is text: its tokens, not its numerics); auto:
    # the faster for batches on this machine, measured (`precision`), and kept in the manifest for a resume
    roots: list[str] = field(default_factory=list)  # folders of Python files; empty: stdlib and site-packages
    # another build's prompts.jsonl.gz, used as the prompt list (its first `max_prompts` rows; 0: all) in
    # place of reading this machine's files: a GPU build on the prompts of a CPU build, with its own batches
    prompts_from: str = ""
    max_prompts: int = 0
    # the decodings that batches take in turn (names of MODES); empty: all of them. Greedy text teaches the
    # SATs best (docs/training.md), so a build for training alone may keep to it
    modes: list[str] = field(default_factory=list)

    def decodings(self) -> tuple[tuple[str, float, float], ...]:
        """The MODES batches take in turn; ValueError naming an unknown one."""
        unknown = [m for m in self.modes if m not in MODE_NAMES]
        if unknown:
            raise ValueError(f"modes must be names among {', '.join(MODE_NAMES)}; got {unknown}")
        return tuple(m for m in MODES if not self.modes or m[0] in self.modes)

    def key(self) -> str:
        """What fixes the prompt list and the shards: a resumed build refuses a recipe that changed it. A
        prompt file counts by its contents, not its path."""
        fixed = {k: v for k, v in asdict(self).items() if k not in ("out", "prompts_from", "max_prompts", "modes")}
        modes = sorted(set(self.modes))
        if modes and modes != sorted(MODE_NAMES):  # all of them is the default
            fixed["modes"] = modes
        if self.prompts_from:  # (left out when unset, so that builds begun before these settings still resume)
            fixed["prompts_from"] = hashlib.sha256(gzip.decompress(Path(self.prompts_from).read_bytes())).hexdigest()
        if self.max_prompts:
            fixed["max_prompts"] = self.max_prompts
        if self.instructions == "templates":
            del fixed["instructions"]
        return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


# -- prompts ----------------------------------------------------------------------------------------

def python_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(Path(paths[k]) for k in ("stdlib", "purelib", "platlib")))


def python_files(roots: list[Path]) -> list[Path]:
    """Python files under `roots`, sorted, skipping tests and files reached twice (by their resolved path)."""
    seen, files = set(), []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if any(part in ("test", "tests", "__pycache__") for part in path.parts):
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if 500 < size < 400_000 and path.resolve() not in seen:
                seen.add(path.resolve())
                files.append(path)
    return files


def _dedent(text: str) -> str:
    indent = len(text) - len(text.lstrip())
    return "".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines(keepends=True))


def code_prompts_of(source: str) -> tuple[list[str], list[tuple[str, str]]]:
    """From one file: code prompts (signature + docstring, class head, module head) and, for chat,
    (signature, docstring summary) pairs of documented functions."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [], []
    lines = source.splitlines(keepends=True)
    prompts, described = [], []
    doc = ast.get_docstring(tree)
    if doc and tree.body and len(tree.body) > 1:  # the module's docstring and what follows up to the first def
        first = next((n for n in tree.body[1:] if isinstance(n, (ast.FunctionDef, ast.ClassDef))), tree.body[-1])
        prompts.append("".join(lines[:max(first.lineno - 1, tree.body[0].end_lineno)]))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
            continue
        docstring = ast.get_docstring(node)
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        if isinstance(node, ast.ClassDef):
            end = node.body[0].end_lineno if docstring else node.body[0].lineno - 1
            prompts.append(_dedent("".join(lines[start - 1:end])))
        elif docstring:
            prompts.append(_dedent("".join(lines[start - 1:node.body[0].end_lineno])))
            summary = docstring.strip().split("\n\n")[0].replace("\n", " ")
            if 20 < len(summary) < 300 and not node.name.startswith("_"):
                signature = _dedent("".join(lines[start - 1:node.body[0].lineno - 1])).strip()
                described.append((signature, summary))
    return [p for p in prompts if 30 < len(p) < 1500], described


_FROM_DOCSTRING = [
    "Write a Python function `{sig}` that does this: {doc}",
    "Explain what this Python function does, and when I would use it:\n\n```python\n{sig}\n```\n\n{doc}",
    "Implement the following in Python.\n\n{sig}\n\"\"\"{doc}\"\"\"",
    "I need a function like `{sig}`. {doc} Can you write it and show an example call?",
]


def build_prompts(recipe: CorpusRecipe, keep: HumanEvalFilter, held_out: set[str]) -> list[dict]:
    """The whole prompt list, in build order: {"text", "chat"} rows, code and chat interleaved."""
    from ..ui.examples import CHAT_EXAMPLES, EXAMPLES

    rng = random.Random(recipe.seed)
    roots = [Path(r) for r in recipe.roots] or python_roots()
    code, described = [], []
    for path in tqdm(python_files(roots), desc="reading Python files", unit="file"):
        try:
            found, pairs = code_prompts_of(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        code += found
        described += pairs
    code = sorted({p for p in code if not keep(p)})
    rng.shuffle(code)
    chat = [template.format(sig=sig, doc=doc) for sig, doc in sorted(set(described))
            for template in [rng.choice(_FROM_DOCSTRING)]]
    chat = [c for c in chat if not keep(c)]
    if recipe.instructions == "templates":
        chat = sorted(set(chat + chat_instructions(10_000, rng) + [row[0] for row in CHAT_EXAMPLES])
                      - {row[0] for row in EXAMPLES})
        rng.shuffle(chat)
    else:  # the varied instructions take turns with those from docstrings, which would otherwise outnumber them
        chat = sorted(set(chat))
        rng.shuffle(chat)
        varied = [c for c in varied_instructions(rng) if not keep(c)]
        examples = {row[0] for row in EXAMPLES}
        chat = [c for c in take_turns(varied, chat) if c not in examples]
        taken = examples | set(chat)
        chat += [text for text in dict.fromkeys(row[0] for row in CHAT_EXAMPLES) if text not in taken]
    code = [row[0] for row in EXAMPLES if not row[1]] + code
    chat = [row[0] for row in EXAMPLES if row[1]] + chat
    code, chat = ([t for t in texts if t not in held_out] for texts in (code, chat))
    rows, c, h = [], 0, 0
    while c < len(code) or h < len(chat):  # interleave so that every stretch of shards has both kinds
        if h < len(chat) and (c >= len(code) or rng.random() < recipe.chat_share):
            rows.append({"text": chat[h], "chat": True})
            h += 1
        else:
            rows.append({"text": code[c], "chat": False})
            c += 1
    return rows


def held_out_texts(folder: Path = HELD_OUT_PROMPTS) -> set[str]:
    """Every prompt of the benchmark's prompt files: measured on, never trained on."""
    texts = set()
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                texts.add(json.loads(line)["prompt"])
    return texts


# -- shards -----------------------------------------------------------------------------------------

def generate_batch(model, tokenizer, encoded: list[list[int]], mode: tuple[str, float, float], max_new_tokens: int,
                   eos_ids: set[int], seed: int) -> list[list[int]]:
    """Each prompt's completion (token ids, up to and including an end token), decoded together in one
    left-padded batch: greedy when the mode's temperature is 0, else sampled with that temperature and top-p."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    device = next(model.parameters()).device
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    _, temperature, top_p = mode
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=sorted(eos_ids), **sampling)
    completions = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        completions.append(row[:cut])
    return completions


def build_shard(model, tokenizer, recipe: CorpusRecipe, index: int, rows: list[dict], keep: HumanEvalFilter,
                eos_ids: set[int]) -> dict:
    """One shard: its prompts grouped by length into batches, each batch in one of MODES."""
    encoded = [encode_prompt(tokenizer, r["text"], chat=r["chat"]) for r in rows]
    order = sorted((i for i, e in enumerate(encoded) if len(e) <= recipe.max_prompt_tokens),
                   key=lambda i: (rows[i]["chat"], len(encoded[i]), i))  # similar lengths: little padding
    sequences, decodings = [], recipe.decodings()
    for b, start in enumerate(range(0, len(order), recipe.batch_size)):
        batch = order[start:start + recipe.batch_size]
        mode = decodings[(index + b) % len(decodings)]
        seed = int(hashlib.sha256(f"{recipe.seed}/{index}/{b}".encode()).hexdigest()[:8], 16)
        completions = generate_batch(model, tokenizer, [encoded[i] for i in batch], mode, recipe.max_new_tokens,
                                     eos_ids, seed)
        for i, completion in zip(batch, completions):
            if completion and not keep(tokenizer.decode(completion)):
                sequences.append({"chat": rows[i]["chat"], "mode": mode[0], "prompt_tokens": len(encoded[i]),
                                  "ids": encoded[i] + completion})
    return {"shard": index, "sequences": sequences}


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.json.gz"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def prepare(recipe: CorpusRecipe) -> list[dict]:
    """The prompt list, made once and kept in the folder with the recipe (a resume reads it back)."""
    recipe.decodings()  # an unknown mode: refused before anything is written
    if recipe.instructions not in INSTRUCTIONS:
        raise ValueError(f"instructions must be one of {', '.join(INSTRUCTIONS)}, got {recipe.instructions!r}")
    if recipe.max_prompts < 0:
        raise ValueError(f"max_prompts must be 0 (all) or more, got {recipe.max_prompts}")
    if recipe.prompts_from and not Path(recipe.prompts_from).is_file():
        raise ValueError(f"prompts_from must name a prompts.jsonl.gz file; {recipe.prompts_from} is not one")
    out = Path(recipe.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / MANIFEST_FILE
    if manifest.is_file():
        stored = json.loads(manifest.read_text())
        if stored["key"] != recipe.key():
            raise ValueError(f"{out} holds a corpus of another recipe ({stored['recipe']}); "
                             "use another --out, or the same settings to resume")
        with gzip.open(out / PROMPTS_FILE, "rt") as f:
            return [json.loads(line) for line in f]
    if recipe.prompts_from:
        with gzip.open(recipe.prompts_from, "rt") as f:
            rows = [json.loads(line) for line in f]
    else:
        rows = build_prompts(recipe, HumanEvalFilter(), held_out_texts())
    if recipe.max_prompts:
        rows = rows[:recipe.max_prompts]
    _write_atomic(out / PROMPTS_FILE, gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    _write_atomic(manifest, json.dumps({"key": recipe.key(), "recipe": asdict(recipe), "prompts": len(rows),
                                        "shards": -(-len(rows) // recipe.shard_prompts)}, indent=1).encode())
    return rows


def stored_dtype(out: Path) -> str | None:
    """The precision a build in `out` was begun in (None where none was): a resume keeps it."""
    manifest = out / MANIFEST_FILE
    return json.loads(manifest.read_text())["recipe"]["dtype"] if manifest.is_file() else None


def build(recipe: CorpusRecipe, shards: int | None = None, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Build the missing shards among the first `shards` (all when None); returns counts of what is on disk.
    A recipe's "auto" precision becomes the one the build in its folder was begun in, else the given model's,
    else the faster on this machine (`precision.resolve_batched_dtype`)."""
    recipe.decodings()  # an unknown mode: refused before a model is loaded
    if recipe.dtype == "auto":
        given = str(next(model.parameters()).dtype).removeprefix("torch.") if model is not None else None
        recipe = replace(recipe, dtype=stored_dtype(Path(recipe.out)) or given
                         or resolve_batched_dtype("auto", recipe.model))
    rows = prepare(recipe)
    out = Path(recipe.out)
    total = -(-len(rows) // recipe.shard_prompts)
    wanted = range(min(total, shards) if shards is not None else total)
    missing = [i for i in wanted if not shard_path(out, i).is_file()]
    if missing and model is None:
        model, tokenizer = load_model(LoadConfig(model=recipe.model, dtype=recipe.dtype))
    if missing:
        keep = HumanEvalFilter()
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        for index in tqdm(missing, desc="corpus shards", unit="shard", disable=not progress):
            started = time.perf_counter()
            shard = build_shard(model, tokenizer, recipe, index,
                                rows[index * recipe.shard_prompts:(index + 1) * recipe.shard_prompts], keep, eos_ids)
            shard["seconds"] = round(time.perf_counter() - started, 1)
            _write_atomic(shard_path(out, index), gzip.compress(json.dumps(shard).encode(), mtime=0))
    return summary(out)


def load_shards(out: Path) -> list[dict]:
    """Every sequence of every shard on disk, in shard order."""
    sequences = []
    for path in sorted(Path(out).glob("shard-*.json.gz")):
        with gzip.open(path, "rt") as f:
            sequences += json.load(f)["sequences"]
    return sequences


def summary(out: Path) -> dict:
    """Shards, sequences and tokens on disk, by kind and mode, and the generation rate."""
    counts: dict[str, int] = {}
    shards = seconds = generated = 0
    for path in sorted(Path(out).glob("shard-*.json.gz")):
        with gzip.open(path, "rt") as f:
            shard = json.load(f)
        shards += 1
        seconds += shard.get("seconds", 0)
        for seq in shard["sequences"]:
            key = f"{'chat' if seq['chat'] else 'code'} {seq['mode']}"
            counts[key] = counts.get(key, 0) + len(seq["ids"])
            generated += len(seq["ids"]) - seq["prompt_tokens"]
    return {"shards": shards, "tokens": sum(counts.values()), "generated_tokens": generated,
            "tokens_by_kind": dict(sorted(counts.items())),
            "generated_per_second": round(generated / seconds, 1) if seconds else None}


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.train.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = CorpusRecipe()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            parser.add_argument(flag, nargs="*", default=value, metavar="MODE" if name == "modes" else "DIR")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--shards", type=int, default=None, help="build only the first N shards (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--summary", action="store_true", help="print what is on disk and build nothing")
    args = vars(parser.parse_args(argv))
    shards, threads, only_summary = args.pop("shards"), args.pop("threads"), args.pop("summary")
    recipe = CorpusRecipe(**args)
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = summary(Path(recipe.out)) if only_summary else build(recipe, shards)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
