"""`python -m sdsat.bench.pass_split`: where a forward pass's time goes, and a decoding loop's around its passes.

A pass's time is split into the decoder layers' products, attention, the SAT updates (the adapter's hooks),
norms and rotary embeddings, the output head, and the rest ("other": embeddings, residual adds, the MLP's
activation, masks, transformers' own Python). A decode's time is split into its forward passes, choosing
tokens (TokenChooser), KV-cache surgery (kvcache.py) and the loop's own Python. Every part is timed by
wrapping the callables that do it for the length of the measurement, so the parts never overlap and "other"
(or "loop Python") is what they leave of the measured total; the wrappers cost a little time of their own,
counted in that rest.

Beside a decode's split it prints the speed-up its passes allow: the arithmetic bound is the vanilla decode's
seconds per pass times the SDSAT decode's tokens, over the SDSAT decode's pass seconds; the measured speed-up
falls short of it by what the loop spends outside its passes (issue 38, item 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import drafters, kvcache, sat, timing, verify
from .. import decoding as decoding_module
from ..kvcache import new_cache, rollback
from ..sampling import TokenChooser

PRODUCTS, ATTENTION, SAT_UPDATES = "layer products", "attention", "SAT updates"
NORMS, HEAD, OTHER = "norms and rotary", "output head", "other"
PASS_PARTS = (PRODUCTS, ATTENTION, SAT_UPDATES, NORMS, HEAD, OTHER)
PASSES, CHOOSING, SURGERY, LOOP = "forward passes", "choosing tokens", "KV-cache surgery", "loop Python"
LOOP_PARTS = (PASSES, CHOOSING, SURGERY, LOOP)


@dataclass
class Split:
    """Seconds of one measured span and of each of its parts; the last part is what the others leave."""

    total_s: float
    parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _Timer:
    """Adds the seconds spent in wrapped callables to their part; a call inside another of its own part (a
    method calling another) is counted once, by the outer one."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._inside: set[str] = set()

    def wrap(self, part: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            if part in self._inside:
                return function(*args, **kwargs)
            self._inside.add(part)
            start = timing.now(self.device)
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += timing.now(self.device) - start
                self._inside.discard(part)

        return timed


@contextlib.contextmanager
def _patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    """Set each (owner, attribute, value) for the block, then put back what was there (or nothing)."""
    missing = object()
    saved = [(owner, name, owner.__dict__.get(name, missing) if hasattr(owner, "__dict__") else getattr(owner, name))
             for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _pass_patches(sat_model, timer: _Timer) -> list[tuple[object, str, object]]:
    """What to wrap in `sat_model`'s model to time the parts of a pass."""
    model = sat_model.model
    head = model.get_output_embeddings()
    patches = []
    for module in model.modules():
        name = type(module).__name__
        if module is head:
            part = HEAD
        elif isinstance(module, nn.Linear):
            part = PRODUCTS
        elif name.endswith("RMSNorm") or isinstance(module, nn.LayerNorm) or "RotaryEmbedding" in name:
            part = NORMS
        else:
            continue
        patches.append((module, "forward", timer.wrap(part, module.forward)))  # the routed kernels' forward too
    modeling = sys.modules[type(model).__module__]  # transformers' modeling file of this family
    if hasattr(modeling, "apply_rotary_pos_emb"):
        patches.append((modeling, "apply_rotary_pos_emb", timer.wrap(NORMS, modeling.apply_rotary_pos_emb)))
    interface = ALL_ATTENTION_FUNCTIONS.get_interface
    patches.append((ALL_ATTENTION_FUNCTIONS, "get_interface",
                    lambda name, default: timer.wrap(ATTENTION, interface(name, default))))
    if hasattr(modeling, "eager_attention_forward"):  # "eager" is called directly, not through the interface
        patches.append((modeling, "eager_attention_forward", timer.wrap(ATTENTION, modeling.eager_attention_forward)))
    adapter = sat_model.adapter
    if adapter is not None:  # the hooks are put in at the first SAT pass, from this list
        patches.append((adapter, "_hooks", [(module, timer.wrap(SAT_UPDATES, hook), pre)
                                            for module, hook, pre in adapter._hooks]))
    return patches


def split_passes(sat_model, blocks: dict[str, tuple[str, int]], context: int = 256, repeats: int = 10,
                 seed: int = 0) -> dict[str, Split]:
    """The median round's split of each block kind behind `context` cached tokens: {label: ("plain", T) or
    ("draft", k)}, a draft block being [t, SAT x k].
    Blocks are interleaved round by round; the first round is dropped."""
    gen = torch.Generator().manual_seed(seed)
    device = sat_model.device
    vocab = sat_model.model.get_input_embeddings().weight.shape[0]
    cache = new_cache(sat_model.model.config)
    with torch.inference_mode():
        sat_model.forward(torch.randint(0, vocab, (1, context), generator=gen).to(device), cache=cache,
                          logits_to_keep=1)
    rounds: dict[str, list[Split]] = {label: [] for label in blocks}
    timer = _Timer(device)
    with _patched(_pass_patches(sat_model, timer)):
        for round_ in range(repeats + 1):
            for label, (kind, size) in blocks.items():
                width = size if kind == "plain" else size + 1
                ids = torch.randint(0, vocab, (1, width), generator=gen).to(device)
                slots = (None if kind == "plain"
                         else torch.cat([torch.tensor([-1]), torch.arange(size)])[None].to(device))
                timer.seconds.clear()
                start = timing.now(device)
                with torch.inference_mode():
                    sat_model.forward(ids, slots, cache=cache, logits_to_keep=width)
                total = timing.now(device) - start
                rollback(cache, context)
                if round_:
                    rounds[label].append(_with_rest(total, timer.seconds, PASS_PARTS))
    return {label: _median(splits) for label, splits in rounds.items()}


def _with_rest(total: float, seconds: dict[str, float], parts: tuple[str, ...]) -> Split:
    named = {part: seconds.get(part, 0.0) for part in parts[:-1]}
    return Split(total, named | {parts[-1]: total - sum(named.values())})


def _median(splits: list[Split]) -> Split:
    """The round whose total is the median (the lower one of an even count), whole: its parts add up to it."""
    return sorted(splits, key=lambda split: split.total_s)[(len(splits) - 1) // 2]


def split_decode(engine, prompt_ids: list[int], config) -> tuple[Split, object]:
    """Run one decode (decoding.decode) with its loop timed: (the split, the GenerationResult)."""
    timer = _Timer(engine.sat_model.device)
    passes = [(module, "call_with_cache", timer.wrap(PASSES, module.call_with_cache))
              for module in (decoding_module, sat)]
    choosing = [(TokenChooser, name, timer.wrap(CHOOSING, getattr(TokenChooser, name)))
                for name in ("choose", "probs", "draw", "draw_ranked") if hasattr(TokenChooser, name)]
    surgery = [(module, name, timer.wrap(SURGERY, getattr(kvcache, name)))
               for module in (kvcache, drafters, verify) for name in ("rollback", "keep_rows")
               if hasattr(module, name)]
    with _patched(passes + choosing + surgery):
        start = timing.now(engine.sat_model.device)
        result = decoding_module.collect(decoding_module.decode(engine.sat_model, engine.tokenizer, prompt_ids,
                                                                config, engine.eos_ids))
        total = timing.now(engine.sat_model.device) - start
    return _with_rest(total, timer.seconds, LOOP_PARTS), result


def arithmetic_bound(vanilla: tuple[Split, object], sdsat: tuple[Split, object]) -> dict[str, float]:
    """The speed-up SDSAT's passes allow over vanilla's (vanilla's seconds per pass times SDSAT's new tokens,
    over SDSAT's pass seconds) beside the measured one (tokens per second, same prompt and run)."""
    (v_split, v_result), (s_split, s_result) = vanilla, sdsat
    v_tokens, s_tokens = len(v_result.token_ids), len(s_result.token_ids)
    v_per_pass = v_split.parts[PASSES] / max(len(v_result.steps), 1)
    bound = v_per_pass * s_tokens / s_split.parts[PASSES]
    measured = (s_tokens / s_split.total_s) / (v_tokens / v_split.total_s)
    return {"bound": bound, "measured": measured, "share_of_bound": measured / bound}


def table(splits: dict[str, Split], parts: tuple[str, ...]) -> str:
    """A markdown table: ms per part and its share of the total, one row per measured span."""
    lines = ["| span | total ms | " + " | ".join(parts) + " |", "|---|---:|" + "---:|" * len(parts)]
    for label, split in splits.items():
        cells = [f"{split.parts[p] * 1e3:.1f} ({split.parts[p] / split.total_s:.0%})" for p in parts]
        lines.append(f"| {label} | {split.total_s * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BLOCKS = {"one token (vanilla)": ("plain", 1), "plain 4 tokens (verify, k = 3)": ("plain", 4),
          "draft [t, SAT x3]": ("draft", 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.pass_split", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256, metavar="N",
                        help="tokens already in the KV cache (default 256)")
    parser.add_argument("--repeats", type=int, default=10, metavar="N",
                        help="timed rounds over every block; medians are reported (default 10)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    parser.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                        help="the prompt the decodes' loops are split on")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="new tokens per decode (default 64)")
    parser.add_argument("--json", metavar="OUT", help="also write the splits (seconds) here (default: none)")
    args = parser.parse_args(argv)

    from ..config import DecodeConfig
    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig, ModelLoadError
    from .runner import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = Engine.load(LoadConfig(model=DEFAULT_MODEL, measure_kernels=False))
    except (ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    engine.use_stored_tuning()
    passes = split_passes(engine.sat_model, BLOCKS, args.context, args.repeats)
    prompt_ids = engine.tokenizer(args.prompt)["input_ids"]
    loops = {method: split_decode(engine, prompt_ids, engine.auto_config(DecodeConfig(
        method=method, max_new_tokens=args.max_new_tokens))) for method in ("vanilla", "sdsat")}
    bound = arithmetic_bound(loops["vanilla"], loops["sdsat"])
    info = machine_info(engine)
    print(f"{info.get('cpu', '')}, {torch.get_num_threads()} threads, KV cache of {args.context} tokens; "
          f"ms of the median pass (its parts add up to it) and each part's share")
    print(table(passes, PASS_PARTS))
    print()
    print(table({method: split for method, (split, _) in loops.items()}, LOOP_PARTS))
    print(f"\nSDSAT over vanilla on this prompt: measured {bound['measured']:.2f}x, arithmetic bound of its passes "
          f"{bound['bound']:.2f}x ({bound['share_of_bound']:.0%} of it)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": info, "context": args.context, "passes": {k: v.to_dict() for k, v in passes.items()},
            "loops": {k: v.to_dict() for k, (v, _) in loops.items()}, "speed_up": bound}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
