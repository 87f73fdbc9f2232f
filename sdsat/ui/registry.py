"""The page's models: loaded once, on first use, and shared read-only by every visitor.

Only names from the operator's list can be loaded, and never with `trust_remote_code`.
"""

from __future__ import annotations

import threading

from ..decoding import DecodeConfig, run
from ..engine import Engine
from ..models import LoadConfig
from .settings import Limits, SettingError


class EngineCache:
    """Engines keyed by the operator's model names; each loads at most once, then is shared."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._engines: dict[str, Engine] = {}
        self._locks = {name: threading.Lock() for name in limits.models}

    def add(self, engine: Engine) -> None:
        """Share an engine loaded elsewhere (tests, a start-up script); its name must be on the list."""
        if engine.name not in self._locks:
            raise SettingError(f"model {engine.name!r} is not on the operator's list: {', '.join(self.limits.models)}")
        self._engines[engine.name] = engine

    def is_loaded(self, name: str) -> bool:
        return isinstance(name, str) and name in self._engines

    def get(self, name: str) -> Engine:
        """The engine for `name`, loading and warming it up on first use.

        Raises:
            SettingError: `name` is not on the operator's list.
            ModelLoadError: the operator listed a model that cannot be loaded.
        """
        if not isinstance(name, str) or name not in self._locks:  # API callers may send any JSON value
            raise SettingError(f"model must be one of: {', '.join(self.limits.models)} (set by the operator); got {name!r}")
        with self._locks[name]:
            if name not in self._engines:
                config = LoadConfig(model=name, device=self.limits.device, dtype=self.limits.dtype, trust_remote_code=False)
                engine = Engine.load(config)
                _warm_up(engine)
                self._engines[name] = engine
        return self._engines[name]


def _warm_up(engine: Engine) -> None:
    """A few tokens of each decoder, so the first visitor's race does not time allocator warm-up."""
    ids = engine.encode("def add(a, b):")
    for method in ("vanilla", "sdsat"):
        run(engine.stream(ids, DecodeConfig(method=method, k=min(4, engine.max_k), max_new_tokens=6)))


def max_context(engine: Engine) -> int | None:
    """The model's context length, where its config states one."""
    value = getattr(engine.model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
