"""The engine: a loaded model, its tokenizer and its SATs, behind one call per request.

The CLI, the app and the benchmark all go through `Engine`; it holds no per-request state, so one
engine serves every visitor of the app.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from . import ASSETS, sat_kernel
from .checkpoints import known_checkpoint
from .decoding import SCHEMES, DecodeConfig, Event, GenerationResult, collect, decode
from .default_model import cache_dir
from .models import DEFAULT_MODEL, LoadConfig, load_model
from .prompts import encode_prompt, eos_ids_of
from .sat import SPEC_FILE, AdapterConfig, SatAdapter, SatModel, SatSpec
from .planner import FALLBACK
from .tuning import TUNING_FILE, TuneProgress, Tuning, fallback_form, tune

log = logging.getLogger(__name__)

DEFAULT_ADAPTER = ASSETS / "adapters" / DEFAULT_MODEL
# An untrained adapter starts from this token's embedding: SmolLM2's unused `<empty_output>`.
_INIT_TOKEN = "<empty_output>"


@dataclass
class SatSource:
    """Where a model's SATs come from; at most one of the fields is set."""

    sat_ids: list[int] | None = None  # the paper's kind: these vocabulary rows are the SATs
    adapter: str | None = None  # a folder with a SAT adapter (adapter_config.json + weights)
    max_k: int | None = None  # largest k; defaults to the spec's or adapter's own


class Activity:
    """How many decodes run now; a tuning behind the page measures only between them."""

    def __init__(self):
        self._running = 0
        self.begun = 0  # decodes begun so far
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        with self._idle:
            self._running += 1
            self.begun += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    @property
    def busy(self) -> bool:
        return self._running > 0

    def wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)


@dataclass
class Engine:
    model: object
    tokenizer: object
    sat_model: SatModel
    name: str
    sat_trained: bool = True  # False while the SATs are a fresh, untrained adapter
    eos_ids: list[int] = field(default_factory=list)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    tuning: Tuning | None = None  # set by `tune` or `use_stored_tuning`
    measuring: TuneProgress | None = None  # while a tuning of this machine runs behind this engine (the app)
    activity: Activity = field(default_factory=Activity, repr=False)  # shared with the engine's twin

    def tune(self, remeasure: str = "missing", on_step: Callable[[TuneProgress], None] | None = None) -> Tuning:
        """Measure this machine's pass costs per precision and plan `auto` settings (tuning.py); may move the
        model to the precision it chose. What is kept on disk for this machine is read, not measured again
        (`remeasure`: see tuning.tune)."""
        if self.tuning is None or remeasure != "missing":
            self.tuning = self._tune(remeasure, on_step)
        return self.tuning

    def use_stored_tuning(self) -> bool:
        """Apply the tuning kept on disk for this machine, measuring nothing; without one, put the model in its
        fallback form (tuning.fallback_form). True when a tuning was there."""
        if self.tuning is None:
            self.tuning = self._tune("never")
        if self.tuning is None:
            fallback_form(self.sat_model, self.load_config.cpu_kernels)
        return self.tuning is not None

    def _tune(self, remeasure: str, on_step=None) -> Tuning | None:
        return tune(self.sat_model, self.name, fixed_dtype=self.load_config.dtype != "auto",
                    kernels=self.load_config.cpu_kernels, cache_file=cache_dir() / TUNING_FILE, remeasure=remeasure,
                    on_step=on_step, requests_begun=lambda: self.activity.begun, warm_up=self._warm_up_to_measure)

    def _warm_up_to_measure(self) -> None:
        if self.tuning is None:
            fallback_form(self.sat_model, self.load_config.cpu_kernels)
        self.warm_up()

    def warm_up(self) -> None:
        """A few tokens of each decoder, so what is timed next (a visitor's race, a tuning) does not time
        allocator and kernel warm-up."""
        log.info("warming up %s: 6 tokens of each decoder", self.name)
        ids = self.encode("def add(a, b):")
        for method in ("vanilla", "sdsat"):
            collect(self.stream(ids, DecodeConfig(method=method, k=min(4, self.max_k), max_new_tokens=6)))

    @property
    def can_twin(self) -> bool:
        """Whether a second copy of the model may be loaded to measure beside this one: a small model, whose
        copies while measuring (the twin, its blocked products, a precision tried) fit in half the memory."""
        from .cpu_kernels import COPY_LIMIT_BYTES

        size = sum(p.numel() * p.element_size() for p in self.model.parameters())
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not reported here
            memory = 0
        return self.load_config.quantization is None and size <= COPY_LIMIT_BYTES and 6 * size <= memory / 2

    def twin(self) -> "Engine":
        """A second engine with its own copy of the model and the same SATs, sharing this one's activity:
        a tuning converts its model in place while this one keeps serving untouched."""
        model, tokenizer = load_model(self.load_config)
        adapter = self.sat_model.adapter.copy() if self.sat_model.adapter is not None else None
        sat_model = SatModel(model, copy.copy(self.sat_model.spec), adapter)
        return dataclasses.replace(self, model=model, tokenizer=tokenizer, sat_model=sat_model, tuning=None,
                                   measuring=None)

    def auto_config(self, config: DecodeConfig, explicit: set[str] = frozenset(), chat: bool = False) -> DecodeConfig:
        """`config` with the planned scheme, k, lookup and tree, except the fields named in `explicit`; without a
        plan (no tuning yet, or SATs without an acceptance trace), two-step with planner.FALLBACK's settings.
        `chat`: the request goes through the chat template (planned over the chat trace, where there is one).
        Measures nothing: call `tune` or `use_stored_tuning` first."""
        tuning = self.tuning
        plan = None
        if tuning is not None:
            sampling = config.sampling
            plan = tuning.plan_for(SCHEMES, greedy=not sampling.do_sample, temperature=sampling.temperature,
                                   top_p=sampling.top_p, top_k=sampling.top_k, chat=chat)
        if plan is None:
            settings = dict(FALLBACK, scheme="two_step",
                            tree_candidates=0 if config.sampling.do_sample else FALLBACK["tree_candidates"])
        else:
            settings = vars(plan.settings)
        chosen = {name: value for name, value in settings.items() if name not in explicit}
        chosen["k"] = min(chosen.get("k", config.k), self.max_k)
        if any(getattr(config, name) for name in ("lookup_tokens", "tree_candidates") if name in explicit):
            chosen["scheme"] = "two_step"  # the caller asked for lookup or a tree, which only two_step has
        return dataclasses.replace(config, **chosen)

    @classmethod
    def load(cls, load_config: LoadConfig | None = None, sats: SatSource | None = None) -> "Engine":
        """Load a model and its SATs: explicit ids or adapter, else a sat_spec.json next to the model,
        else a known checkpoint's (checkpoints.py), else the shipped default adapter, else a fresh
        untrained adapter."""
        load_config = load_config or LoadConfig()
        sats = sats or SatSource()
        model, tokenizer = load_model(load_config)
        spec, adapter, trained = _resolve_sats(model, tokenizer, load_config.model, sats)
        sat_model = SatModel(model, spec, adapter)
        if adapter is not None and sat_model.device.type == "cpu":
            sat_kernel.start_build()  # its draft passes use PyTorch's ops until the compiled update is ready
        return cls(model, tokenizer, sat_model, load_config.model, trained, eos_ids_of(model, tokenizer), load_config)

    @property
    def max_k(self) -> int:
        return self.sat_model.max_k

    @property
    def chat_available(self) -> bool:
        """Whether prompts may go through a chat template: the tokenizer has one, and the model is meant for it."""
        checkpoint = known_checkpoint(self.name)
        return bool(getattr(self.tokenizer, "chat_template", None)) and (checkpoint is None or checkpoint.chat)

    def encode(self, prompt: str, chat: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids of `prompt`; special-token text such as ``<|im_end|>`` stays text unless `allow_special`."""
        return encode_prompt(self.tokenizer, prompt, chat=chat, allow_special=allow_special)

    def stream(self, prompt_ids: list[int], config: DecodeConfig, should_stop=None) -> Iterator[Event]:
        """Step records as they happen, then the result (see `decoding.decode`, which checks the request now)."""
        return self._counted(decode(self.sat_model, self.tokenizer, prompt_ids, config, self.eos_ids, should_stop))

    def _counted(self, events: Iterator[Event]) -> Iterator[Event]:
        with self.activity.decoding():
            yield from events

    def generate(self, prompt: str, config: DecodeConfig, chat: bool = False) -> GenerationResult:
        return collect(self.stream(self.encode(prompt, chat), config))


def _resolve_sats(model, tokenizer, model_name: str, sats: SatSource) -> tuple[SatSpec, SatAdapter | None, bool]:
    if sats.sat_ids is not None:
        return SatSpec(kind="vocab", sat_ids=list(sats.sat_ids), max_k=sats.max_k or 15), None, True
    folder = sats.adapter
    if folder is None and Path(model_name, SPEC_FILE).is_file():
        spec = SatSpec.load(model_name)
        if spec.kind == "vocab":
            spec.max_k = sats.max_k or spec.max_k
            return spec, None, True
        folder = spec.adapter
    checkpoint = known_checkpoint(model_name)
    if folder is None and checkpoint is not None:
        return SatSpec(kind="vocab", sat_ids=[checkpoint.sat_id], max_k=min(sats.max_k or checkpoint.max_k,
                                                                             checkpoint.max_k)), None, True
    if folder is None and model_name == DEFAULT_MODEL and (DEFAULT_ADAPTER / "adapter_config.json").is_file():
        folder = str(DEFAULT_ADAPTER)
    if folder is not None:
        adapter = SatAdapter.load(folder)
        k = min(sats.max_k or adapter.config.num_sats, adapter.config.num_sats)
        return SatSpec(kind="adapter", max_k=k, adapter=str(folder)), adapter, True
    log.warning("no trained SATs for %s: using an untrained adapter (drafts will rarely be accepted)", model_name)
    config = AdapterConfig(base_model=model_name, hidden_size=model.get_input_embeddings().weight.shape[1],
                           num_layers=model.config.num_hidden_layers, num_sats=sats.max_k or 8)
    init = tokenizer.convert_tokens_to_ids(_INIT_TOKEN) if _INIT_TOKEN in tokenizer.get_vocab() else None
    adapter = SatAdapter.for_model(model, config, init_token_id=init)
    return SatSpec(kind="adapter", max_k=config.num_sats), adapter, False
