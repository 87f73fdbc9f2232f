"""The small public API in `sdsat/__init__.py`, and what a record says about itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sdsat
from sdsat import DecodeConfig, Engine, GenerationResult, LoadConfig, SamplingConfig, StepRecord
from sdsat.records import KINDS

ROOT = Path(__file__).resolve().parent.parent


def test_the_public_names_are_the_engines_own():
    from sdsat.engine import Engine as engine_class
    from sdsat.models import LoadConfig as load_class

    assert Engine is engine_class and LoadConfig is load_class and set(sdsat.__all__) >= {
        "Engine", "LoadConfig", "DecodeConfig", "SamplingConfig", "GenerationResult", "StepRecord"}


def test_importing_a_submodule_does_not_load_the_engine():
    probe = "import sys, sdsat.hardware; print('transformers' in sys.modules, 'sdsat.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_docstring_example_runs_and_its_records_say_what_they_are(default_engine):
    config = DecodeConfig(k=3, max_new_tokens=24, lookup_tokens=8, sampling=SamplingConfig())
    result = default_engine.generate("def fib(n):\n    if n < 2:\n        return n\n    return fib(", config)
    assert isinstance(result, GenerationResult) and all(isinstance(s, StepRecord) for s in result.steps)
    assert {s.kind for s in result.steps} <= set(KINDS) - {"vanilla", "fused", "tree"}
    for step in result.steps:
        assert step.forward_passes == 1 + step.draft_pass
        assert (step.draft_pass_seconds is not None) == step.draft_pass
        assert step.to_dict()["draft_source"] in ("sat", "lookup")
