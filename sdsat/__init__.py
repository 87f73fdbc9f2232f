"""SDSAT: speculative decoding with semantic adaptive tokens (arXiv 2403.18647).

    from sdsat import DecodeConfig, Engine, LoadConfig
    engine = Engine.load(LoadConfig())                      # the embedded default model and its SATs
    result = engine.generate("def fib(n):", DecodeConfig(k=3, max_new_tokens=64))
    print(result.text, result.tokens_per_forward_pass)

The public names load lazily, so importing one submodule does not import them all.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .interrupt import take_over_if_a_command

# Started as `python -m sdsat` or `python app.py`: from here on, before the imports that take seconds, Ctrl-C ends
# the process with one line and exit status 130 (interrupt.py says why it cannot be a KeyboardInterrupt then).
take_over_if_a_command()

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # shipped adapters, prompts, results, page text

_PUBLIC = {
    "Engine": "engine",
    "LoadConfig": "models",
    "DecodeConfig": "config",
    "SamplingConfig": "sampling",
    "GenerationResult": "records",
    "StepRecord": "records",
}
__all__ = ["ASSETS", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'sdsat' has no attribute {name!r}")
