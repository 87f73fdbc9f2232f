"""The page's models: loaded once, on first use, and shared read-only by every visitor.

Only names from the operator's list can be loaded, and never with `trust_remote_code`.
"""

from __future__ import annotations

import logging
import threading
import time

from ..decoding import DecodeConfig, collect
from ..engine import Engine
from ..errors import first_line
from ..models import LoadConfig, ModelLoadError
from .settings import Limits, SettingError
from .zerogpu import on_zero_gpu

log = logging.getLogger(__name__)


class EngineCache:
    """Engines keyed by the operator's model names; each loads at most once, then is shared.

    A model that fails to load is not retried for `limits.load_retry_s` seconds: requests in that
    window (and those that were waiting for the failed load) get its reason at once instead of
    queueing behind another slow failure; the first request after it tries again.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self._engines: dict[str, Engine] = {}
        self._locks = {name: threading.Lock() for name in limits.models}
        self._failures: dict[str, tuple[float, ModelLoadError]] = {}  # name -> (when, why) of its last failed load

    def add(self, engine: Engine) -> None:
        """Share an engine loaded elsewhere (tests, a start-up script); its name must be on the list."""
        if engine.name not in self._locks:
            raise SettingError(f"model {engine.name!r} is not on the operator's list: {', '.join(self.limits.models)}")
        self._engines[engine.name] = engine

    def is_loaded(self, name: str) -> bool:
        return isinstance(name, str) and name in self._engines

    def failure(self, name: str) -> str | None:
        """Why `name` last failed to load, while that failure stands; None otherwise."""
        recorded = self._failures.get(name) if isinstance(name, str) else None
        return str(recorded[1]) if recorded else None

    def get(self, name: str, warm_up: bool = True) -> Engine:
        """The engine for `name`, loading it on first use; with `warm_up`, it also measures this machine for
        auto (`_measure`) and runs a few tokens.

        Raises:
            SettingError: `name` is not on the operator's list.
            ModelLoadError: the operator listed a model that cannot be loaded (now or in the last
                `load_retry_s` seconds).
        """
        if not isinstance(name, str) or name not in self._locks:  # API callers may send any JSON value
            raise SettingError(f"model must be one of: {', '.join(self.limits.models)} (set by the operator); "
                               f"got {name!r}")
        if name in self._engines:
            return self._engines[name]
        self._raise_recent_failure(name)
        with self._locks[name]:
            if name not in self._engines:
                self._raise_recent_failure(name)
                self._engines[name] = self._load(name, warm_up)
        return self._engines[name]

    def _load(self, name: str, warm_up: bool) -> Engine:
        config = LoadConfig(model=name, device=self.limits.device, dtype=self.limits.dtype,
                            quantization=self.limits.quantization, trust_remote_code=False)
        try:
            engine = Engine.load(config)
            if warm_up:
                _measure(engine)
                _warm_up(engine)
        except Exception as err:  # whatever breaks a load, the server keeps serving and says why
            error = err if isinstance(err, ModelLoadError) else ModelLoadError(
                f"cannot load model {name!r}: {type(err).__name__}: {first_line(err)}")
            self._failures[name] = (time.monotonic(), error)
            log.warning("%s (the server keeps serving; a request after %g s tries again)", error,
                        self.limits.load_retry_s, exc_info=not isinstance(err, (ModelLoadError, OSError)))
            raise error from err
        self._failures.pop(name, None)
        return engine

    def _raise_recent_failure(self, name: str) -> None:
        recorded = self._failures.get(name)
        if recorded and time.monotonic() - recorded[0] < self.limits.load_retry_s:
            raise recorded[1]



def _measure(engine: Engine) -> None:
    """This machine's pass costs and auto's plan (`Engine.tune`, which may move the model to the precision it
    chooses), once per load and before any request decodes. Not on ZeroGPU, where a GPU is attached only inside
    a request. A failure leaves the engine unmeasured (the page then keeps its default settings and says so)."""
    if on_zero_gpu():
        return
    try:
        engine.tune()
    except Exception as err:  # the model still decodes; only auto's plan is missing
        log.warning("could not measure the pass costs of %s (%s: %s); auto keeps its default settings", engine.name,
                    type(err).__name__, first_line(err), exc_info=True)


def _warm_up(engine: Engine) -> None:
    """A few tokens of each decoder, so the first visitor's race does not time allocator warm-up."""
    ids = engine.encode("def add(a, b):")
    for method in ("vanilla", "sdsat"):
        collect(engine.stream(ids, DecodeConfig(method=method, k=min(4, engine.max_k), max_new_tokens=6)))


def max_context(engine: Engine) -> int | None:
    """The model's context length, where its config states one."""
    value = getattr(engine.model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
