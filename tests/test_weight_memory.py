"""The weights in one block (sdsat/weight_memory.py): the same model, its parameters views of one mapping."""

from __future__ import annotations

import torch

from conftest import make_tiny_llama
from sdsat import weight_memory


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_gathered_weights_give_the_same_logits_from_one_block():
    model = make_tiny_llama()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    assert len(_storages(model)) > 1
    assert weight_memory.gather(model) and weight_memory.gathered(model)
    assert len(_storages(model)) == 1  # every parameter a view of the block
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert weight_memory.gather(model)  # a second call leaves it as it is
    assert len(_storages(model)) == 1


def test_tied_weights_stay_tied_and_a_conversion_takes_the_weights_out_again():
    model = make_tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    assert weight_memory.gather(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] = 7.0
    assert float(model.lm_head.weight.detach()[0, 0]) == 7.0
    model.to(torch.bfloat16)  # new storage for every weight: no longer gathered, gathered again on request
    assert not weight_memory.gathered(model)
    assert weight_memory.gather(model) and weight_memory.gathered(model)
    assert len(_storages(model)) == 1 and model.lm_head.weight.dtype == torch.bfloat16


def test_a_tuning_that_tries_another_precision_leaves_the_model_as_it_was(default_engine):
    """`tuning.trying` converts the model (gathering it anew) and puts its earlier tensors back: the model is
    again in its own block, and nothing on it holds the block of the precision tried."""
    from sdsat import tuning

    sat_model = default_engine.sat_model
    precision = tuning.dtype_name(sat_model.model)
    other = "bfloat16" if precision == "float32" else "float32"
    weight_memory.gather(sat_model.model)
    before = _storages(sat_model.model)
    with tuning.trying(sat_model, other, True, tuning.ROUTED):
        assert weight_memory.gathered(sat_model.model) and _storages(sat_model.model) != before
    assert _storages(sat_model.model) == before
    assert not any(isinstance(value, torch.Tensor) and value.numel() > 1 << 20
                   for value in vars(sat_model.model).values())
