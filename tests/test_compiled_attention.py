"""The compiled attention form (sdsat/csrc/attend.cpp): each row of a pass exactly as the same token alone, over
causal blocks, a cache's room and a draft tree's gaps; attention to the precision's rounding; greedy SDSAT in
this form identical to vanilla on the real model; and the tuner offers it only where it is built."""

from __future__ import annotations

import pytest
import torch

from sdsat import attention, cpu_kernels, native, tuning
from sdsat.costs import check_rows
from sdsat.decoding import DecodeConfig
from conftest import tree_seen

NO_INDEX = torch.empty(0, dtype=torch.long)


@pytest.fixture
def kernel(native_kernels):
    return native_kernels


def _attend(query, key, value, seen):
    return attention.compiled_attention(None, query, key, value, None if seen is None else seen[None, None],
                                        0.125)[0]


@pytest.mark.parametrize("precision", tuning.CPU_PRECISIONS)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 128), (4, 2, 32), (16, 2, 256)])
def test_each_row_is_the_same_token_alone_and_the_result_is_attention(kernel, precision, heads, kv_heads, dim):
    torch.manual_seed(0)
    dtype, rows = getattr(torch, precision), 11
    assert kernel.applies(heads, kv_heads, dim)
    for cached in (0, 5, 15, 16, 17, 300):  # key counts on both sides of a vector's width
        keys = cached + rows
        query = torch.randn(1, heads, rows, dim).to(dtype)
        room = torch.randn(2, 1, kv_heads, keys + 40, dim).to(dtype)  # a cache with room past its keys
        key, value = room[0, :, :, :keys], room[1, :, :, :keys]
        causal = torch.arange(keys)[None, :] <= cached + torch.arange(rows)[:, None]
        out = _attend(query, key, value, causal)
        assert torch.equal(out, _attend(query, key.contiguous(), value.contiguous(), None))  # causal: no mask
        for t in range(rows):
            n = cached + t + 1
            alone = _attend(query[:, :, t:t + 1], key[:, :, :n], value[:, :, :n], None)
            assert torch.equal(out[:, t], alone[:, 0]), (cached, t)
        reference = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=causal, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out.float(), reference.transpose(1, 2),
                                   atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    parents = [-1, 0, 1, 2, 1, 2, 1, 2, 4]  # a draft tree: runner-ups of nodes 1, 2 and 4
    for cached in (40, 64 - len(parents)):
        seen = tree_seen(parents, cached)
        query = torch.randn(1, heads, len(parents), dim).to(dtype)
        key, value = (torch.randn(1, kv_heads, seen.shape[1], dim).to(dtype) for _ in range(2))
        out = _attend(query, key, value, seen)
        for node in range(len(parents)):
            index = seen[node].nonzero().squeeze(-1)
            alone = _attend(query[:, :, node:node + 1], key[:, :, index], value[:, :, index], None)
            assert torch.equal(out[:, node], alone[:, 0]), (cached, node)
        reference = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=seen, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out.float(), reference.transpose(1, 2),
                                   atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


def test_a_long_prompt_split_between_threads_gives_each_row_as_alone(kernel):
    """A prompt's pass big enough to be split between threads: every row as the same token alone on one thread,
    so threads change no bits."""
    torch.manual_seed(2)
    rows, cached, threads = 64, 200, torch.get_num_threads()
    query = torch.randn(1, 9, rows, 64).to(torch.bfloat16)
    key, value = (torch.randn(1, 3, cached + rows, 64).to(torch.bfloat16) for _ in range(2))
    torch.set_num_threads(2)
    try:
        out = _attend(query, key, value, None)
        torch.set_num_threads(1)
        for t in range(0, rows, 7):
            n = cached + t + 1
            assert torch.equal(out[:, t], _attend(query[:, :, t:t + 1], key[:, :, :n], value[:, :, :n], None)[:, 0])
    finally:
        torch.set_num_threads(threads)


def test_a_built_extension_loads_from_its_file_without_ninja_or_a_build(kernel, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(cpp_extension, "load_inline", no_build)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", None)
    assert native.built()
    module = native.build()
    assert module is not None and module.applies(9, 3, 64) and not module.applies(9, 3, 48)


def test_bad_rows_are_refused_not_read_past_the_cache(kernel):
    query, key = torch.randn(1, 4, 2, 64), torch.randn(1, 2, 10, 64)
    with pytest.raises(RuntimeError, match="key count"):
        kernel.attend(query, key, key, torch.tensor([10, 11]), NO_INDEX, 0.125)
    with pytest.raises(RuntimeError, match="key index"):
        kernel.attend(query, key, key, torch.tensor([2, 2]), torch.tensor([[0, 1], [0, 10]]), 0.125)


def test_a_model_the_kernel_does_not_take_attends_one_row_at_a_time_in_every_pass(kernel):
    """Head size 16 (or soft-capped scores): the per-row form's numerics, the same for a lone row and a block."""
    torch.manual_seed(1)
    query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    assert not kernel.applies(4, 2, 16)
    causal = torch.arange(8)[None, :] <= 5 + torch.arange(3)[:, None]
    assert torch.equal(_attend(query, key, value, causal),
                       attention.per_row_attention(None, query, key, value, causal[None, None], 0.125)[0])


def test_greedy_sdsat_in_the_compiled_form_is_identical_to_vanilla_on_the_real_model(kernel, default_engine,
                                                                                      monkeypatch):
    """The shipped model and SATs in bfloat16 with the compiled attention: its rows check bit-equal, and greedy
    SDSAT (the chain, and lookup with a draft tree) gives vanilla's tokens in this form."""
    if not cpu_kernels.invariant_available(torch.bfloat16):
        pytest.skip("no row-invariant bfloat16 products here (oneDNN's or the compiled kernel)")
    sat_model = default_engine.sat_model
    prompt = "def running_max(values):\n    \"\"\"Return the running maximum of a list.\"\"\"\n"
    with tuning.trying(sat_model, "bfloat16", default_engine.load_config.cpu_kernels, tuning.COMPILED):
        assert default_engine.model.config._attn_implementation == attention.COMPILED
        with torch.inference_mode():
            assert check_rows(sat_model).invariant
        vanilla = default_engine.generate(prompt, DecodeConfig(method="vanilla", max_new_tokens=40))
        for config in (DecodeConfig(method="sdsat", k=3, max_new_tokens=40),
                       DecodeConfig(method="sdsat", k=2, lookup_tokens=10, tree_candidates=4, max_new_tokens=40)):
            sdsat = default_engine.generate(prompt, config)
            assert sdsat.token_ids == vanilla.token_ids, config
            assert len(sdsat.token_ids) / len(sdsat.steps) > 1.3


def test_the_tuner_offers_the_compiled_form_only_where_it_is_built_and_on(monkeypatch):
    monkeypatch.setenv("SDSAT_ATTENTION_KERNEL", "1")
    monkeypatch.setattr(native, "built", lambda: False)
    assert tuning.COMPILED not in tuning.exact_forms("bfloat16")
    assert tuning._routed_forms("bfloat16") == [tuning.ROUTED]
    monkeypatch.setattr(native, "built", lambda: True)
    if cpu_kernels.invariant_available(torch.bfloat16):
        assert tuning.exact_forms("bfloat16")[0] == tuning.COMPILED
    else:  # no row-invariant form at all in a precision whose products this CPU lacks
        assert tuning.exact_forms("bfloat16") == ()
    assert tuning.exact_forms("float32")[0] == tuning.COMPILED and tuning.KEYED not in tuning.exact_forms("float32")
    assert tuning._routed_forms("float32") == [tuning.ROUTED, tuning.ROUTED_COMPILED]
    monkeypatch.setenv("SDSAT_ATTENTION_KERNEL", "0")
    assert tuning.COMPILED not in tuning.exact_forms("bfloat16")
