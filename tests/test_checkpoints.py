"""Known SDSAT checkpoints: a folder laid out like the paper's CodeLlama checkpoints gets its SATs from the table."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import measure_quickly
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sdsat.checkpoints import known_checkpoint
from sdsat.decoding import DecodeConfig, collect
from sdsat.engine import Engine
from sdsat.models import LoadConfig, resolve_dtype
from sdsat.ui.handlers import MODEL_OUTPUTS, Page
from sdsat.ui.settings import REQUEST_INPUTS, Limits

SAT_ID = 32011  # the paper's checkpoints' SAT: a vocabulary row past the tokenizer's 32000 ids
WORDS = "def return if else for in range a b c x y n + - * = ( ) : , 0 1 2".split()
BOS = 1


def save_tiny_checkpoint(folder: Path) -> Path:
    """A random Llama laid out like an SDSAT checkpoint: the SAT is a row of its vocabulary, no sat_spec.json,
    and a tokenizer that adds BOS before raw text (as CodeLlama's does)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32016, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=BOS, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The tiny checkpoints' tuning goes to a folder of the test's own, not the user's cache (it would grow by
    two entries a run, keyed by the temporary folder)."""
    monkeypatch.setenv("SDSAT_CACHE", str(tmp_path / "sdsat"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "CodeLlama-SDSAT_L5_7B")


def test_the_table_names_the_papers_checkpoints_by_hub_id_folder_and_hub_cache():
    seven = known_checkpoint("ainergy/CodeLlama-SDSAT_L5_7B")
    assert (seven.sat_id, seven.max_k, seven.dtype, seven.chat) == (SAT_ID, 15, "float16", False)
    assert known_checkpoint("/models/codellama-sdsat_l5_7b/") == seven
    snapshot = "/root/.cache/huggingface/hub/models--ainergy--CodeLlama-SDSAT_L7_13B/snapshots/0123abc"
    assert known_checkpoint(snapshot).repo == "ainergy/CodeLlama-SDSAT_L7_13B"
    assert known_checkpoint("smollm2-135m-instruct") is None and known_checkpoint("/models/llama") is None


def test_auto_dtype_is_the_checkpoints_own_on_a_gpu_and_float32_on_a_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cuda, "ainergy/CodeLlama-SDSAT_L5_7B") == torch.float16
    assert resolve_dtype("auto", cuda, "someone/another-model") == torch.bfloat16
    assert resolve_dtype("auto", cpu, "ainergy/CodeLlama-SDSAT_L5_7B") == torch.float32
    assert resolve_dtype("bfloat16", cuda, "ainergy/CodeLlama-SDSAT_L5_7B") == torch.bfloat16


def test_a_folder_like_the_papers_checkpoint_gets_its_sats_from_the_table(checkpoint: Path):
    engine = Engine.load(LoadConfig(model=str(checkpoint), cpu_kernels=False))
    spec = engine.sat_model.spec
    assert spec.kind == "vocab" and set(spec.sat_ids) == {SAT_ID} and engine.max_k == 15 and engine.sat_trained
    assert not engine.chat_available
    ids = engine.encode("def add ( a , b ) :")
    assert ids[0] == BOS and ids.count(BOS) == 1  # the tokenizer's BOS, once
    vanilla = collect(engine.stream(ids, DecodeConfig(method="vanilla", max_new_tokens=24)))
    for k in (1, 15):
        sdsat = collect(engine.stream(ids, DecodeConfig(method="sdsat", k=k, max_new_tokens=24)))
        assert sdsat.token_ids == vanilla.token_ids
        assert all(len(step.drafts) == k for step in sdsat.steps if step.draft_source == "sat")


def test_the_same_folder_under_another_name_gets_no_table_entry(checkpoint: Path, tmp_path: Path):
    renamed = tmp_path / "my-llama"
    renamed.symlink_to(checkpoint, target_is_directory=True)
    engine = Engine.load(LoadConfig(model=str(renamed), cpu_kernels=False))
    assert engine.sat_model.spec.kind == "adapter" and not engine.sat_trained


def test_the_page_races_a_known_checkpoint_and_hides_chat(checkpoint: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SDSAT_CACHE", str(tmp_path))  # the checkpoint's tuning is kept here, not in the user's cache
    measure_quickly(monkeypatch)
    page = Page(Limits(models=[str(checkpoint)]))
    controls = dict(zip(MODEL_OUTPUTS, page.model_controls(str(checkpoint))))
    assert controls["k"]["maximum"] == 15
    assert controls["chat"]["visible"] is False and controls["chat_examples"]["visible"] is False
    request = ("def add ( a , b ) :", str(checkpoint), False, "greedy", 15, 16, 1.0, 1.0, 0, 0, 0, 0)
    result = page.generate_sync(dict(zip(REQUEST_INPUTS, request)))
    assert result["identical"] is True and result["sdsat"]["token_ids"] == result["vanilla"]["token_ids"]
    # The machine is measured for it behind the page; that ends here, not beside the next tests.
    deadline = time.monotonic() + 600
    while page.cache.get(str(checkpoint)).measuring is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert page.cache.get(str(checkpoint)).tuning is not None
