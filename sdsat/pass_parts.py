"""Where a forward pass's time goes: its parts timed by wrapping the callables that do them.

A pass's time is split into the decoder layers' products, attention, the SAT updates (the adapter's hooks),
norms and rotary embeddings, the output head, and the rest ("other": embeddings, residual adds, the MLP's
activation, masks, transformers' own Python). The parts never overlap (the SAT update a routed product calls
counts as an update, not as the product), and "other" is what they leave of the measured total; the wrappers
cost a little time of their own, counted in the parts they wrap and in that rest. The benchmark
(`python -m sdsat.bench.pass_split`) and the page's This machine panel both use it.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import timing
from .kvcache import new_cache, rollback

PRODUCTS, ATTENTION, SAT_UPDATES = "layer products", "attention", "SAT updates"
NORMS, HEAD, OTHER = "norms and rotary", "output head", "other"
PASS_PARTS = (PRODUCTS, ATTENTION, SAT_UPDATES, NORMS, HEAD, OTHER)


@dataclass
class Split:
    """Seconds of one measured span and of each of its parts; the last part is what the others leave."""

    total_s: float
    parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class Timer:
    """Adds the seconds spent in wrapped callables to their part, each part's own time only: a call of another part
    inside (the SAT update a routed product calls) counts for that part alone, and a call of a part already
    running further out (a method calling another) counts for the part it was called from."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[list] = []  # the calls running, outermost first: [part, seconds spent in inner parts]

    def wrap(self, part: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            if any(call[0] == part for call in self._open):
                return function(*args, **kwargs)
            call = [part, 0.0]
            self._open.append(call)
            start = timing.now(self.device)
            try:
                return function(*args, **kwargs)
            finally:
                spent = timing.now(self.device) - start
                self._open.pop()
                self.seconds[part] += spent - call[1]
                if self._open:
                    self._open[-1][1] += spent

        return timed


@contextlib.contextmanager
def patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
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


def _pass_patches(sat_model, timer: Timer) -> list[tuple[object, str, object]]:
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
    timer = Timer(device)
    with patched(_pass_patches(sat_model, timer)):
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
                    rounds[label].append(with_rest(total, timer.seconds, PASS_PARTS))
    return {label: median_round(splits) for label, splits in rounds.items()}


def with_rest(total: float, seconds: dict[str, float], parts: tuple[str, ...]) -> Split:
    named = {part: seconds.get(part, 0.0) for part in parts[:-1]}
    return Split(total, named | {parts[-1]: total - sum(named.values())})


def median_round(splits: list[Split]) -> Split:
    """The round whose total is the median (the lower one of an even count), whole: its parts add up to it."""
    return sorted(splits, key=lambda split: split.total_s)[(len(splits) - 1) // 2]

