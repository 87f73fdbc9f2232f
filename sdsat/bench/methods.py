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
two_step whose verify pass also checks the SATs' runner-up candidates, or under sampling further draws
(`DecodeConfig.tree_candidates`), and lookup_tree: both. The recipe `auto` takes scheme, k, lookup and
tree from the engine's tuning (`Engine.tune().plan`; sampled runs its plan for sampling at their
temperature, top-p and top-k) and ignores the k sweep.

Vanilla may also run on a second engine in another precision (`Variant.precision`, labelled e.g.
"vanilla bfloat16"): the fastest plain decoding of any precision is the headline's baseline.

Forward passes are counted the same way for all of them, by a forward hook on the model, so tokens
per forward pass compares `model.generate` with the engine honestly.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Iterator, NamedTuple

import torch
from transformers import GenerationConfig

from .. import timing
from ..decoding import MAX_TREE_CANDIDATES, DecodeConfig, collect
from ..config import SCHEMES
from ..engine import Engine
from ..planner import Settings
from ..sampling import SamplingConfig
from ..tuning import Tuning

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
AUTO = "auto"  # the recipe whose settings come from the engine's tuning
SCHEME_CHOICES = (*RECIPES, AUTO)  # what --schemes accepts


@dataclass(frozen=True)
class AutoChoice:
    """What the auto recipe decodes with, and the record each of its runs carries (JSON field "auto")."""

    settings: Settings  # scheme, k, lookup_tokens and tree_candidates
    record: dict = field(default_factory=dict, compare=False, hash=False)  # {"settings", "plan", "note"}


def auto_choices(tuning: Tuning, max_k: int, temperatures: tuple[float, ...] = (), top_p: float = 1.0,
                 top_k: int = 0, chat: bool = False) -> tuple[AutoChoice, dict[float, AutoChoice]]:
    """The auto recipe's choices from a tuning: its greedy plan, and per sampling temperature the plan for
    sampling at it (`plan_for(greedy=False)`), chat's plans where `chat`; without a plan (no acceptance trace)
    the default settings and the note."""
    def choice(plan) -> AutoChoice:
        settings = plan.settings if plan is not None else Settings()
        settings = Settings(settings.scheme, min(settings.k, max_k), settings.lookup_tokens, settings.tree_candidates)
        return AutoChoice(settings, {"settings": asdict(settings), "plan": plan.to_dict() if plan is not None else None,
                                     "note": tuning.note})

    sampled = {t: choice(tuning.plan_for(SCHEMES, greedy=False, temperature=t, top_p=top_p, top_k=top_k, chat=chat))
               for t in temperatures}
    return choice(tuning.plan_for(SCHEMES, greedy=True, chat=chat)), sampled


@dataclass(frozen=True)
class Variant:
    """A method with its settings: one row of the summary."""

    method: str  # one of METHODS
    k: int = 0  # drafts per step: SDSAT's k, prompt lookup's prompt_lookup_num_tokens; 0 if none
    temperature: float | None = None  # sampling methods only
    recipe: str = "two_step"  # SDSAT methods: one of SCHEME_CHOICES
    auto: AutoChoice | None = None  # the auto recipe: its settings (k is also in `k`)
    precision: str | None = None  # vanilla on a baseline engine in this precision; None: the main engine

    @property
    def greedy(self) -> bool:
        return self.method in GREEDY_METHODS

    @property
    def label(self) -> str:
        return label_of(self.method, self.k, self.temperature, self.recipe,
                        asdict(self.auto.settings) if self.auto else None, self.precision,
                        planned=self.auto is not None and self.auto.record.get("plan") is not None)


def label_of(method: str, k: int, temperature: float | None, recipe: str = "two_step", settings: dict | None = None,
             precision: str | None = None, planned: bool = True) -> str:
    """How a variant is named in tables and figures, e.g. "sdsat_sample k=4 T=0.2", "sdsat_greedy k=3 fused",
    "vanilla bfloat16" or "sdsat_greedy auto (k=3 +lookup+tree8)" (the auto recipe names what it chose)."""
    auto = recipe == AUTO
    parts = ([method] + ([f"k={k}"] if k and not auto else []) + ([precision] if precision else [])
             + ([f"T={temperature:g}"] if temperature is not None else []))
    if auto:
        return " ".join(parts + [f"auto ({'' if planned else 'no plan: '}{_describe(settings or {}, k)})"])
    suffix = RECIPES[recipe].suffix
    return " ".join(parts + ([suffix] if suffix else []))


def _describe(settings: dict, k: int) -> str:
    """Settings in a label's words: "k=3 +lookup+tree8", "k=2 fused"."""
    scheme, lookup, tree = (settings.get(name) for name in ("scheme", "lookup_tokens", "tree_candidates"))
    return (f"k={settings.get('k', k)}" + (" fused" if scheme == "fused" else "") + (" +lookup" if lookup else "")
            + (f"{'' if lookup else ' '}+tree{tree}" if tree else ""))


def run_label(run: dict) -> str:
    """The label of a JSON run record (as `Variant.label` names the variant that made it)."""
    auto = run.get("auto") or {}
    return label_of(run["method"], run["k"], run["temperature"], run.get("scheme", "two_step"), auto.get("settings"),
                    run.get("precision"), planned=auto.get("plan") is not None)


def plan_variants(methods: list[str], k_list: list[int], sample_k: int, temperatures: list[float],
                  lookup_tokens: int, max_k: int, recipes: tuple[str, ...] = ("two_step",),
                  tree_candidates: int = 2, auto: tuple[AutoChoice, dict[float, AutoChoice]] | None = None,
                  baselines: tuple[str, ...] = ()) -> list[Variant]:
    """The variants of a run, in a fixed order (vanilla first when present).

    `auto`: the auto recipe's (greedy, per temperature sampled) choices (`auto_choices`), needed when
    `recipes` names it.
    `baselines`: precisions vanilla also runs in, each on its own engine (with vanilla only).
    """
    _check_settings(methods, k_list, sample_k, temperatures, max_k, recipes, tree_candidates)
    if AUTO in recipes and auto is None and any(m.startswith("sdsat") for m in methods):
        raise ValueError("--schemes auto needs the engine's tuning (auto_choices)")
    fixed = [r for r in recipes if r != AUTO]
    variants: list[Variant] = []
    for method in METHODS:  # canonical order, whatever order the user listed
        if method not in methods:
            continue
        if method == "prompt_lookup":
            variants.append(Variant(method, k=lookup_tokens))
        elif method == "sdsat_greedy":
            variants.extend(Variant(method, k=k, recipe=r) for r in fixed for k in sorted(set(k_list)))
            if auto is not None and AUTO in recipes:
                variants.append(Variant(method, k=auto[0].settings.k, recipe=AUTO, auto=auto[0]))
        elif method == "vanilla_sample":
            variants.extend(Variant(method, temperature=t) for t in temperatures)
        elif method == "sdsat_sample":
            for r in fixed:
                variants.extend(Variant(method, k=sample_k, temperature=t, recipe=r) for t in temperatures)
            if auto is not None and AUTO in recipes:
                variants.extend(Variant(method, k=auto[1][t].settings.k, temperature=t, recipe=AUTO, auto=auto[1][t])
                                for t in temperatures)
        else:
            variants.append(Variant(method))
            if method == "vanilla":
                variants.extend(Variant(method, precision=p) for p in dict.fromkeys(baselines))
    return variants


def _check_settings(methods, k_list, sample_k, temperatures, max_k, recipes, tree_candidates) -> None:
    """plan_variants' range checks, before any model time is spent: one line naming the setting."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    fixed = [r for r in recipes if r != AUTO]
    sampled_k = [sample_k] if "sdsat_sample" in methods and any(r != AUTO for r in recipes) else []
    too_big = [k for k in (k_list if fixed else []) + sampled_k if not 1 <= k <= max_k]
    if any(m.startswith("sdsat") for m in methods) and too_big:
        raise ValueError(f"k values {too_big} are outside 1..{max_k}, the range this model's SATs support")
    if not recipes or any(r not in SCHEME_CHOICES for r in recipes):
        raise ValueError(f"--schemes must be among {', '.join(SCHEME_CHOICES)}, got {list(recipes)}")
    if any(RECIPES[r].tree for r in fixed) and not 1 <= tree_candidates <= MAX_TREE_CANDIDATES:
        raise ValueError(f"--tree-candidates must be between 1 and {MAX_TREE_CANDIDATES} for the tree recipes "
                         f"(--schemes tree, lookup_tree), got {tree_candidates}")
    for t in temperatures:  # the sampling config's own range check
        try:
            SamplingConfig(do_sample=True, temperature=t).validate()
        except ValueError as err:
            raise ValueError(f"--temperatures: {err}") from None


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
    # The auto recipe: {"settings": what it decoded with, "plan": Plan.to_dict() or None, "note": the tuning's note}
    auto: dict | None = None
    precision: str | None = None  # vanilla on a baseline engine in this precision; None: the main engine's

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
            seed: int | None = None, top_p: float = 1.0, top_k: int = 0, lookup_ngram: int = 2, lookup_tokens: int = 10,
            tree_candidates: int = 2, prompt_index: int = -1, repeat: int = 0) -> Measurement:
    """Generate once with `variant` and return the timed record."""
    if variant.method in ("generate", "prompt_lookup"):
        return _measure_generate(engine, variant, prompt_ids, max_new_tokens, lookup_ngram, prompt_index, repeat)
    sampling = SamplingConfig()
    if not variant.greedy:
        sampling = SamplingConfig(do_sample=True, temperature=variant.temperature, top_p=top_p, top_k=top_k,
                                  seed=seed)
    if variant.auto is not None:  # the plan's own scheme, copies and runner-ups
        planned = variant.auto.settings
        scheme, lookup, tree = planned.scheme, True, True
        lookup_tokens, tree_candidates = planned.lookup_tokens, planned.tree_candidates
    else:
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
        kinds_per_iteration=[s.kind for s in steps], auto=variant.auto.record if variant.auto else None,
        precision=variant.precision)


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

