"""The real default model: it loads from the package, and greedy SDSAT on it equals vanilla decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdsat.decoding import DecodeConfig, collect
from sdsat.models import DEFAULT_MODEL, LoadConfig, ModelLoadError, cache_dir, load_model

ROOT = Path(__file__).resolve().parent.parent
# (prompt, chat, k): raw code to continue and a chat message, a small k and the largest.
CASES = [("def fib(n):", False, 2), ("import numpy as np\n\ndef mean(xs):", False, 5), ("Name three colours.", True, 5)]
NEW_TOKENS = 12


def test_loads_from_the_package_with_a_weight_cache_and_without_bitsandbytes():
    # A fresh interpreter: in this one another test may have imported anything.
    script = ("import json, sys\nfrom sdsat.engine import Engine\nengine = Engine.load()\n"
              "print(json.dumps({'bnb': 'bitsandbytes' in sys.modules, 'max_k': engine.max_k, "
              "'device': str(engine.sat_model.device), 'eos': engine.eos_ids}))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["bnb"] is False
    assert loaded["device"] == "cpu" or torch.cuda.is_available()
    assert loaded["max_k"] >= 1 and loaded["eos"]
    folder = cache_dir() / DEFAULT_MODEL  # the de-quantized weights, cached by the first load
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize("prompt, chat, k", CASES)
def test_greedy_sdsat_equals_vanilla_and_generate(default_engine, prompt: str, chat: bool, k: int):
    engine = default_engine
    ids = engine.encode(prompt, chat=chat)
    with torch.inference_mode():
        out = engine.model.generate(torch.tensor([ids], device=engine.sat_model.device), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, eos_token_id=engine.eos_ids,
                                    pad_token_id=engine.eos_ids[0],
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    reference = out[0, len(ids):].tolist()
    vanilla = collect(engine.stream(ids, DecodeConfig(method="vanilla", max_new_tokens=NEW_TOKENS)))
    sdsat = engine.generate(prompt, DecodeConfig(method="sdsat", k=k, max_new_tokens=NEW_TOKENS), chat=chat)
    assert vanilla.token_ids == reference
    assert sdsat.token_ids == reference
    assert sdsat.text == vanilla.text and sdsat.text.strip()
    assert sdsat.forward_passes == 2 * len(sdsat.steps)
    assert all(len(step.drafts) == k for step in sdsat.steps)


@pytest.mark.parametrize("model, message", [
    ("/no/such/folder", "no such folder"),
    ("no-such-org/no-such-model", "no-such-org/no-such-model"),
])
def test_a_model_that_cannot_load_says_which_and_why(model: str, message: str):
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model(LoadConfig(model=model))
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def test_a_folder_without_a_model_is_refused(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(LoadConfig(model=str(tmp_path)))


def test_quantized_loading_on_cpu_is_refused_before_bitsandbytes_is_needed():
    with pytest.raises(ModelLoadError, match="CUDA"):
        load_model(LoadConfig(quantization="4bit", device="cpu"))
