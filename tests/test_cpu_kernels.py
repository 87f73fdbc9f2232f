"""The small-batch kernel routing: every variant computes nn.Linear's product, the plan is kept, and
training and wide blocks are left to nn.Linear."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
from torch import nn

from conftest import make_tiny_llama
from sdsat import cpu_kernels
from sdsat.cpu_kernels import VARIANTS, KernelPlan


def _plan_of(model: nn.Module, variant: str, max_rows: int = 8) -> KernelPlan:
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    return KernelPlan({shape: [variant] * max_rows for shape in shapes})


ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
ONEDNN_BF16 = pytest.mark.skipif(not cpu_kernels.onednn_invariant(torch.bfloat16),
                                 reason="oneDNN's bfloat16 products need AVX-512 or AMX, which this CPU lacks")


@pytest.mark.parametrize("variant", [v if not v.startswith("onednn") else pytest.param(v, marks=ONEDNN)
                                     for v in VARIANTS])
def test_every_variant_computes_the_linear_product(variant):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=True)
    x = torch.randn(3, 5, 24)  # 15 rows: wider than the plan, falls back
    with torch.inference_mode():
        expected_small, expected_wide = layer(x[:1, :4]), layer(x)
        assert cpu_kernels.install(layer, _plan_of(layer, variant)) == (0 if variant == "linear" else 1)
        small, wide = layer(x[:1, :4]), layer(x)
    torch.testing.assert_close(small, expected_small, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wide, expected_wide, rtol=0, atol=0)
    cpu_kernels.uninstall(layer)
    assert "forward" not in layer.__dict__


def test_routed_model_gives_the_same_logits_and_gradients_fall_back(tiny_llama):
    ids = torch.tensor([[3, 7, 11, 5, 9]])
    with torch.inference_mode():
        expected = tiny_llama(input_ids=ids).logits
    plan = _plan_of(tiny_llama, "weight_left")
    assert cpu_kernels.install(tiny_llama, plan) == sum(isinstance(m, nn.Linear) for m in tiny_llama.modules())
    calls, me = [], threading.get_ident()  # this thread's products only: an earlier module's server may still tune
    original = cpu_kernels._product
    cpu_kernels._product = lambda *a: (threading.get_ident() == me and calls.append(a[0])) or original(*a)
    try:
        with torch.inference_mode():
            routed = tiny_llama(input_ids=ids).logits
        assert calls and set(calls) == {"weight_left"}
        calls.clear()
        loss = tiny_llama(input_ids=ids).logits.sum()  # gradients on: nn.Linear as is
        loss.backward()
        assert not calls
    finally:
        cpu_kernels._product = original
    torch.testing.assert_close(routed, expected, rtol=1e-4, atol=1e-5)


def test_tune_times_each_shape_and_keeps_the_plan_on_disk(tmp_path, monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    cache = tmp_path / "kernels.json"
    plan = cpu_kernels.tune(model, max_rows=4, repeats=1, cache_file=cache)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    assert set(plan.choices) == shapes
    assert all(len(v) == 4 and set(v) <= set(VARIANTS) for v in plan.choices.values())
    stored = json.loads(cache.read_text())
    assert list(stored.values()) == [plan.summary()]
    # Plans of an earlier format (other variants) are dropped when a new one is written.
    cache.write_text(json.dumps({"[1, \"old cpu\"]": {"8x8": ["transposed"]}} | stored))
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    cpu_kernels.tune(model, max_rows=3, repeats=1, cache_file=cache)
    kept = json.loads(cache.read_text())
    assert not [key for key in kept if key.startswith("[1,")] and len(kept) == 2  # max_rows 4 and 3
    # A new process (no in-memory plan) reads the stored one instead of timing again.
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    monkeypatch.setattr(cpu_kernels, "_product", lambda *a: pytest.fail("tuned again instead of reading the file"))
    assert cpu_kernels.tune(model, max_rows=4, repeats=1, cache_file=cache).choices == plan.choices


def test_wide_blocks_are_timed_at_a_few_row_counts_and_take_the_next_ones_choice(monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    timed, me = set(), threading.get_ident()  # this thread's products only, as above
    original = cpu_kernels._product
    monkeypatch.setattr(cpu_kernels, "_product", lambda v, x, *a: (
        threading.get_ident() == me and timed.add(x.shape[0])) or original(v, x, *a))
    plan = cpu_kernels.tune(model, max_rows=26, repeats=1)
    assert timed == set(range(1, 17)) | {20, 24, 26}
    for choices in plan.choices.values():
        assert len(choices) == 26
        assert choices[16:20] == [choices[19]] * 4 and choices[20:24] == [choices[23]] * 4  # 17..20, 21..24


@ONEDNN
def test_onednn_forms_are_offered_and_the_packed_copy_only_below_the_limit():
    assert cpu_kernels._available_variants(1 << 20) == VARIANTS
    # bfloat16 weights too, where the CPU has the instructions oneDNN's bfloat16 path needs; else only ours
    bf16 = cpu_kernels._available_variants(1 << 20, torch.bfloat16)
    assert bf16 == (VARIANTS if cpu_kernels.onednn_invariant(torch.bfloat16) else ("linear", "weight_left"))
    assert cpu_kernels._available_variants(cpu_kernels.COPY_LIMIT_BYTES + 1) == ("linear", "weight_left", "onednn")


def test_default_model_is_routed_by_its_plan_and_agrees_with_nn_linear(default_engine):
    model = default_engine.model
    plan = model._sdsat_kernel_plan
    for module in model.modules():
        if isinstance(module, nn.Linear):
            assert ("forward" in module.__dict__) == (set(plan.choices[tuple(module.weight.shape)]) != {"linear"})
    ids = torch.tensor([default_engine.encode("def fibonacci(n):")])
    with torch.inference_mode():
        routed = model(input_ids=ids[:, :5]).logits  # 5 rows: within the plan
        cpu_kernels.uninstall(model)
        try:
            plain = model(input_ids=ids[:, :5]).logits
        finally:
            cpu_kernels.install(model, plan)
    torch.testing.assert_close(routed, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(routed.argmax(-1), plain.argmax(-1))


def test_large_models_get_no_second_copy_of_their_weights(monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    monkeypatch.setattr(cpu_kernels, "COPY_LIMIT_BYTES", 1)  # every model is "large"
    plan = cpu_kernels.tune(model, max_rows=3, repeats=1)
    assert all("onednn_packed" not in v for v in plan.choices.values())
    cpu_kernels.install(model, plan)
    assert all(getattr(m, "_sdsat_packed", None) is None for m in model.modules())


def test_a_damaged_plan_file_is_replaced(tmp_path, monkeypatch):
    model = make_tiny_llama()
    cache = tmp_path / "kernels.json"
    for damaged in ("null", "[]", "{not json"):
        cache.write_text(damaged)
        monkeypatch.setattr(cpu_kernels, "_PLANS", {})
        plan = cpu_kernels.tune(model, max_rows=2, repeats=1, cache_file=cache)
        assert list(json.loads(cache.read_text()).values()) == [plan.summary()]


def test_a_torn_plan_file_beside_a_stale_temporary_file_is_replaced_by_a_valid_one(tmp_path, monkeypatch):
    # What a kill during a save leaves: half the file, and the temporary file the save was writing (its process
    # gone, or one whose id this process now has). A start that may not measure sets the torn file aside; the
    # next re-tune writes a whole plan, and the temporary files are gone.
    model = make_tiny_llama()
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    whole = json.dumps({"a key": cpu_kernels.tune(model, max_rows=2, repeats=1, cache_file=cache).summary()}, indent=1)
    stale = [tmp_path / "kernels.tmp999999999", tmp_path / f"kernels.tmp{os.getpid()}"]
    for torn in (cache, *stale):
        torn.write_text(whole[:len(whole) // 2])
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    assert cpu_kernels.tune(model, max_rows=2, repeats=1, cache_file=cache, measure=False) is None
    assert not cache.exists() and (tmp_path / "kernels.json.bad").exists()
    cache.write_text(whole[:len(whole) // 2])  # torn again: the re-tune finds it so
    plan = cpu_kernels.tune(model, max_rows=2, repeats=1, cache_file=cache)
    assert list(json.loads(cache.read_text()).values()) == [plan.summary()]
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("damage", ["variant", "length", "shape", "type", "name"])
def test_a_plan_with_bad_entries_is_set_aside_and_tuned_again(tmp_path, monkeypatch, caplog, damage):
    # A file that parses but holds a bad plan (edited by hand, or a broken write) must never reach install().
    model = make_tiny_llama()
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    plan = cpu_kernels.tune(model, max_rows=2, repeats=1, cache_file=cache)
    (key, entry), = json.loads(cache.read_text()).items()
    shape = next(iter(entry))
    bad = {"variant": entry | {shape: ["linear", "no_such_kernel"]}, "length": entry | {shape: ["linear"]},
           "shape": {"1x1": ["linear", "linear"]} | entry, "type": entry | {shape: 7},
           "name": entry | {"4x": ["linear"] * 2}}
    cache.write_text(json.dumps({key: bad[damage]}))
    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    with caplog.at_level(logging.WARNING, logger="sdsat.cpu_kernels"):
        again = cpu_kernels.tune(model, max_rows=2, repeats=1, cache_file=cache)
    assert set(again.choices) == set(plan.choices) and cpu_kernels.install(model, again) >= 0
    assert [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()] == [
        f"CPU kernel plan file {cache} is damaged (its plan for this machine and model has bad entries), "
        "set aside as kernels.json.bad; tuning again"]
    assert json.loads((tmp_path / "kernels.json.bad").read_text()) == {key: bad[damage]}
    assert list(json.loads(cache.read_text()).values()) == [again.summary()]
    assert not list(tmp_path.glob("*.tmp*"))  # written through a temporary file, renamed into place
    cpu_kernels.uninstall(model)


@pytest.mark.parametrize("variant,dtype", [
    pytest.param("invariant", torch.float32, marks=ONEDNN),
    pytest.param("invariant", torch.bfloat16, marks=[ONEDNN, ONEDNN_BF16]),
    ("native", torch.float32), ("native", torch.bfloat16)])
def test_invariant_form_gives_a_row_the_same_bits_alone_and_in_any_block(variant, dtype, request):
    """Inputs wider than one chunk (down_proj's 1536 in SmolLM2) are cut into chunks by oneDNN's form; the compiled
    kernel tiles rows by four: every row of a block of 2..40 rows equals the row multiplied alone, bit for bit, and
    the product agrees with nn.Linear."""
    if variant == "native":
        request.getfixturevalue("native_kernels")
    torch.manual_seed(0)
    layer = nn.Linear(1600, 48, bias=False).to(dtype)
    x = torch.randn(40, 1600, dtype=dtype)
    with torch.inference_mode():
        expected = layer(x)
        assert cpu_kernels.install(layer, cpu_kernels.invariant_plan(layer, variant)) == 1
        assert cpu_kernels.installed_plan(layer).invariant
        alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
        for rows in (2, 3, 5, 8, 16, 33, 40):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(alone.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_the_compiled_product_is_row_invariant_for_any_shape_weights_and_threads(native_kernels):
    """Outputs not a multiple of a tile, inputs not a multiple of a vector, bfloat16 weights under float32 rows and
    the reverse, every block of 1 to 20 rows (each tile shape and the widening threshold): each row's bits as alone,
    and the same on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    try:
        for out_features, in_features in ((37, 50), (5, 17), (200, 576), (1, 8), (3, 40)):
            for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
                w = torch.randn(out_features, in_features, generator=gen).to(w_dtype)
                x = torch.randn(20, in_features, generator=gen).to(x_dtype)
                blocks = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    block = native_kernels.linear(x, w)
                    assert block.dtype == x_dtype and block.shape == (20, out_features)
                    for rows in range(1, 21):
                        assert torch.equal(native_kernels.linear(x[:rows].contiguous(), w), block[:rows])
                        assert torch.equal(native_kernels.linear(x[rows - 1:rows].contiguous(), w),
                                           block[rows - 1:rows])
                    blocks.append(block)
                assert torch.equal(blocks[0], blocks[1])
                expected = x.double() @ w.double().t()
                tolerance = 1e-4 if x_dtype == torch.float32 else 2e-2
                torch.testing.assert_close(blocks[0].double(), expected, rtol=tolerance, atol=tolerance)
    finally:
        torch.set_num_threads(before)


def test_the_faster_invariant_kernel_is_chosen_once_and_kept(native_kernels, tmp_path, monkeypatch):
    """Where oneDNN's form and the compiled kernel both run, one is timed against the other on the model's own
    weights once, kept in the plan file and read back; SDSAT_LINEAR_KERNEL=0 leaves oneDNN's alone."""
    if not cpu_kernels.onednn_invariant():
        pytest.skip("oneDNN's blocked products are not in this torch build: nothing to choose between")
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))
    plan_file = tmp_path / "plans.json"
    monkeypatch.setattr(cpu_kernels, "_INVARIANT", {})
    chosen = cpu_kernels.invariant_variant(model, plan_file)
    assert chosen in cpu_kernels.INVARIANT_VARIANTS
    assert list(json.loads(plan_file.read_text()).values()) == [chosen]
    monkeypatch.setattr(cpu_kernels, "_INVARIANT", {})  # a new process: read back, not timed
    monkeypatch.setattr(cpu_kernels, "_product", lambda *a: pytest.fail("timed again"))
    assert cpu_kernels.invariant_variant(model, plan_file) == chosen
    assert all(set(v) == {chosen} for v in cpu_kernels.invariant_plan(model, cache_file=plan_file).summary().values())
    monkeypatch.setenv("SDSAT_LINEAR_KERNEL", "0")
    assert cpu_kernels.invariant_variant(model, plan_file) == "invariant"


@pytest.mark.skipif(not cpu_kernels.onednn_invariant(), reason="no oneDNN blocked products in this torch")
def test_a_tuning_packs_each_weight_once_and_a_changed_weight_again():
    """Within `reusing_packs`, routing the same weights again reuses their packed copy (a tuning switches forms
    dozens of times); a weight changed in place, or given a new tensor, is packed anew; packs of tensors the model
    no longer holds are dropped, and nothing is kept after the block."""
    model = nn.Sequential(nn.Linear(24, 40, bias=False))
    layer = model[0]
    plan = cpu_kernels.invariant_plan(model, "invariant")
    x = torch.randn(3, 24)
    with cpu_kernels.reusing_packs(model):
        cpu_kernels.install(model, plan)
        first = layer._sdsat_packed
        cpu_kernels.uninstall(model)
        cpu_kernels.install(model, plan)
        assert layer._sdsat_packed is first
        with torch.no_grad():
            layer.weight.mul_(2)  # in place: the version counter moves
        cpu_kernels.install(model, plan)
        assert layer._sdsat_packed is not first
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), x @ layer.weight.t())  # the doubled weight's product
        doubled, before = layer.weight.data, layer._sdsat_packed
        # a conversion: a new tensor (a float32 copy where this CPU has no oneDNN bfloat16 products)
        converted = doubled.to(torch.bfloat16) if cpu_kernels.onednn_invariant(torch.bfloat16) else doubled.clone()
        layer.weight.data = converted
        cpu_kernels.install(model, plan)
        assert layer._sdsat_packed is not before and layer._sdsat_packed[0].dtype == converted.dtype
        layer.weight.data = doubled  # put back, as `tuning.trying` does: the bfloat16 pack is stale now
        cpu_kernels.drop_stale_packs(model)
        assert not model._sdsat_pack_memo
    assert "_sdsat_pack_memo" not in model.__dict__
    packed = layer._sdsat_packed
    cpu_kernels.install(model, plan)
    assert layer._sdsat_packed is not packed
