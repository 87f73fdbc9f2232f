"""The decoders the benchmark races, and `measure`, which times any of them on one prompt.

Methods (names used by `--methods` and in every output):
  vanilla         the engine's autoregressive loop, greedy: the reference every speed-up divides by
  generate        transformers' `model.generate`, greedy
  prompt_lookup   `model.generate` with prompt lookup decoding (drafts copied from the prompt), greedy
  sdsat_greedy    the engine's SDSAT draft-then-verify, greedy, once per k and recipe
  vanilla_sample  the engine's loop, sampling at each temperature
  sdsat_sample    SDSAT with speculative sampling, at each temperature

SDSAT recipes (the entries of `--schemes`; a recipe is a DecodeConfig.scheme with prompt lookup and
the draft tree on or off): two_step (the paper), fused, lookup: two_step where prompt lookup's copies,
when there are any, are verified in place of a SAT draft step (`DecodeConfig.lookup_tokens`), tree:
two_step whose verify pass also checks the SATs' runner-up candidates (`DecodeConfig.tree_candidates`;
greedy only, so sampling runs it as the chain and lists it under two_step), and lookup_tree: both.

Forward passes are counted the same way for all of them, by a forward hook on the model, so tokens
per forward pass compares `model.generate` with the engine honestly.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Iterator, NamedTuple

import torch
from transformers import GenerationConfig

from .. import timing
from ..decoding import MAX_TREE_CANDIDATES, DecodeConfig, collect
from ..engine import Engine
from ..sampling import SamplingConfig

GREEDY_METHODS = ("vanilla", "generate", "prompt_lookup", "sdsat_greedy")
SAMPLE_METHODS = ("vanilla_sample", "sdsat_sample")
METHODS = GREEDY_METHODS + SAMPLE_METHODS


class Recipe(NamedTuple):
    """How SDSAT decodes in one benchmark variant (named by `--schemes` and the JSON's "scheme" field)."""

    scheme: str  # DecodeConfig.scheme
    lookup: bool  # prompt lookup on
    tree: bool  # draft tree on
    suffix: str  # what labels append


RECIPES = {"two_step": Recipe("two_step", False, False, ""), "fused": Recipe("fused", False, False, "fused"),
           "lookup": Recipe("two_step", True, False, "+lookup"), "tree": Recipe("two_step", False, True, "+tree"),
           "lookup_tree": Recipe("two_step", True, True, "+lookup+tree")}


def _without_tree(recipe: str) -> str:
    """What sampling runs for a recipe: trees are greedy only, so a tree recipe samples as its chain."""
    parts = RECIPES[recipe]
    return "lookup" if parts.lookup else parts.scheme


@dataclass(frozen=True)
class Variant:
    """A method with its settings: one row of the summary."""

    method: str  # one of METHODS
    k: int = 0  # drafts per step: SDSAT's k, prompt lookup's prompt_lookup_num_tokens; 0 if none
    temperature: float | None = None  # sampling methods only
    recipe: str = "two_step"  # SDSAT methods: one of RECIPES

    @property
    def greedy(self) -> bool:
        return self.method in GREEDY_METHODS

    @property
    def label(self) -> str:
        return label_of(self.method, self.k, self.temperature, self.recipe)


def label_of(method: str, k: int, temperature: float | None, recipe: str = "two_step") -> str:
    """How a variant is named in tables and figures, e.g. "sdsat_sample k=4 T=0.2" or "sdsat_greedy k=3 fused"."""
    parts = [method] + ([f"k={k}"] if k else []) + ([f"T={temperature:g}"] if temperature is not None else [])
    suffix = RECIPES[recipe].suffix
    return " ".join(parts + ([suffix] if suffix else []))


def plan_variants(methods: list[str], k_list: list[int], sample_k: int, temperatures: list[float],
                  lookup_tokens: int, max_k: int, recipes: tuple[str, ...] = ("two_step",),
                  tree_candidates: int = 2) -> list[Variant]:
    """The variants of a run, in a fixed order (vanilla first when present)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    too_big = [k for k in k_list + ([sample_k] if "sdsat_sample" in methods else []) if not 1 <= k <= max_k]
    if any(m.startswith("sdsat") for m in methods) and too_big:
        raise ValueError(f"k values {too_big} are outside 1..{max_k}, the range this model's SATs support")
    if not recipes or any(r not in RECIPES for r in recipes):
        raise ValueError(f"--schemes must be among {', '.join(RECIPES)}, got {list(recipes)}")
    if any(RECIPES[r].tree for r in recipes) and not 1 <= tree_candidates <= MAX_TREE_CANDIDATES:
        raise ValueError(f"--tree-candidates must be between 1 and {MAX_TREE_CANDIDATES} for the tree recipes "
                         f"(--schemes tree, lookup_tree), got {tree_candidates}")
    for t in temperatures:  # the sampling config's own range check, before any model time is spent
        try:
            SamplingConfig(do_sample=True, temperature=t).validate()
        except ValueError as err:
            raise ValueError(f"--temperatures: {err}") from None
    variants: list[Variant] = []
    for method in METHODS:  # canonical order, whatever order the user listed
        if method not in methods:
            continue
        if method == "prompt_lookup":
            variants.append(Variant(method, k=lookup_tokens))
        elif method == "sdsat_greedy":
            variants.extend(Variant(method, k=k, recipe=r) for r in recipes for k in sorted(set(k_list)))
        elif method == "vanilla_sample":
            variants.extend(Variant(method, temperature=t) for t in temperatures)
        elif method == "sdsat_sample":
            sampled = dict.fromkeys(_without_tree(r) for r in recipes)
            variants.extend(Variant(method, k=sample_k, temperature=t, recipe=r) for r in sampled for t in temperatures)
        else:
            variants.append(Variant(method))
    return variants


@dataclass(kw_only=True)
class Measurement:
    """One timed generation: an entry of the JSON's "runs" (see `to_dict`)."""

    prompt_index: int
    repeat: int  # 0..repeats-1
    method: str
    k: int
    temperature: float | None
    seed: int | None  # sampling seed; None for greedy
    new_tokens: int
    token_ids: list[int]  # new tokens only
    text: str
    seconds: float  # wall time of the call, prefill included, tokenization excluded
    tokens_per_second: float
    forward_passes: int  # calls of the model's forward, counted by a hook
    stop_reason: str  # "eos" or "max_new_tokens"
    # Per iteration (engine methods; None for model.generate, which does not report them):
    tokens_per_iteration: list[int] | None  # tokens emitted, the bonus token counted
    drafted_per_iteration: list[int] | None  # drafts proposed (SDSAT's k; 0 for vanilla)
    accepted_per_iteration: list[int] | None  # drafts accepted (bonus not counted)
    recipe: str = "two_step"  # SDSAT methods: one of RECIPES
    passes_per_iteration: list[int] | None = None  # engine methods: forward passes of each iteration
    kinds_per_iteration: list[str] | None = None  # engine methods: what each iteration was (records.KINDS)

    @property
    def tokens_per_forward_pass(self) -> float:
        return self.new_tokens / self.forward_passes if self.forward_passes else float("nan")

    def to_dict(self) -> dict:
        """The JSON record, in which the recipe has always been called "scheme"."""
        return {("scheme" if name == "recipe" else name): value for name, value in asdict(self).items()}


@contextlib.contextmanager
def count_forward_passes(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count forward passes inside the block; read the count from the yielded list.

    The hook sits on the decoder stack (`get_decoder()`), which every pass runs once, whether it came
    through the model's forward or went to the decoder directly (the fused scheme's projected pass).
    """
    count = [0]

    def hook(module, args, output):
        count[0] += 1

    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    handle = body.register_forward_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


def measure(engine: Engine, variant: Variant, prompt_ids: list[int], max_new_tokens: int,
            seed: int | None = None, top_p: float = 1.0, lookup_ngram: int = 2, lookup_tokens: int = 10,
            tree_candidates: int = 2, prompt_index: int = -1, repeat: int = 0) -> Measurement:
    """Generate once with `variant` and return the timed record."""
    if variant.method in ("generate", "prompt_lookup"):
        return _measure_generate(engine, variant, prompt_ids, max_new_tokens, lookup_ngram, prompt_index, repeat)
    sampling = SamplingConfig()
    if not variant.greedy:
        sampling = SamplingConfig(do_sample=True, temperature=variant.temperature, top_p=top_p, seed=seed)
    scheme, lookup, tree, _ = RECIPES[variant.recipe]
    config = DecodeConfig(method="sdsat" if variant.method.startswith("sdsat") else "vanilla",
                          k=variant.k or 1, max_new_tokens=max_new_tokens, sampling=sampling, scheme=scheme,
                          lookup_tokens=lookup_tokens if lookup else 0, lookup_ngram=lookup_ngram,
                          tree_candidates=tree_candidates if tree else 0)
    return _measure_engine(engine, variant, prompt_ids, config, seed, prompt_index, repeat)


def _measure_engine(engine: Engine, variant: Variant, prompt_ids, config: DecodeConfig, seed, prompt_index,
                    repeat) -> Measurement:
    device = next(engine.model.parameters()).device
    with count_forward_passes(engine.model) as passes:
        start = timing.now(device)
        result = collect(engine.stream(prompt_ids, config))
        seconds = timing.now(device) - start
    steps = result.steps
    return Measurement(
        prompt_index=prompt_index, repeat=repeat, method=variant.method, k=variant.k, temperature=variant.temperature,
        seed=None if variant.greedy else seed, new_tokens=len(result.token_ids), token_ids=list(result.token_ids),
        text=result.text, seconds=seconds, tokens_per_second=len(result.token_ids) / seconds, forward_passes=passes[0],
        stop_reason=result.stop_reason, tokens_per_iteration=[len(s.tokens) for s in steps],
        drafted_per_iteration=[len(s.drafts) for s in steps], accepted_per_iteration=[s.accepted for s in steps],
        recipe=variant.recipe, passes_per_iteration=[s.forward_passes for s in steps],
        kinds_per_iteration=[s.kind for s in steps])


def _measure_generate(engine: Engine, variant: Variant, prompt_ids, max_new_tokens, lookup_ngram, prompt_index,
                      repeat) -> Measurement:
    model = engine.model
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)  # (1, T)
    # Every setting that could make generate differ from plain greedy is pinned, so the model's own
    # generation_config (repetition penalty, sampling defaults) cannot leak in.
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0,
                    eos_token_id=engine.eos_ids, pad_token_id=_pad_id(engine))
    if variant.method == "prompt_lookup":
        settings.update(prompt_lookup_num_tokens=variant.k, max_matching_ngram_size=lookup_ngram)
    config = GenerationConfig(**settings)
    with count_forward_passes(model) as passes, torch.inference_mode():
        start = timing.now(device)
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        seconds = timing.now(device) - start
    tokens = output[0, len(prompt_ids):].tolist()
    stop = "eos" if tokens and tokens[-1] in engine.eos_ids else "max_new_tokens"
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    return Measurement(prompt_index=prompt_index, repeat=repeat, method=variant.method, k=variant.k, temperature=None,
                       seed=None, new_tokens=len(tokens), token_ids=tokens, text=text, seconds=seconds,
                       tokens_per_second=len(tokens) / seconds, forward_passes=passes[0], stop_reason=stop,
                       tokens_per_iteration=None, drafted_per_iteration=None, accepted_per_iteration=None)


def _pad_id(engine: Engine) -> int:
    pad = engine.tokenizer.pad_token_id
    return pad if pad is not None else engine.eos_ids[0]

