"""The SAT rows' compiled update (sdsat/sat_kernel.py): the same update as PyTorch's ops, to rounding, and
lossless decoding with it on the real model; where it cannot be built, PyTorch's ops do the work."""

from __future__ import annotations

import pytest
import torch

from sdsat import native, sat_kernel
from sdsat.decoding import DecodeConfig
from sdsat.sat import SatModel
from test_decoding import seven_projection_model as seven_projections


@pytest.fixture
def kernel(native_kernels, monkeypatch):
    monkeypatch.setenv("SDSAT_ATTENTION_KERNEL", "0")  # the update alone
    return native_kernels


def seven_projection_model(dtype: torch.dtype) -> SatModel:
    sat_model = seven_projections(b_scale=0.05)
    sat_model.model.to(dtype)  # the adapter stays float32, as after tuning.set_precision on a CPU
    return sat_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_update_matches_pytorchs_ops(kernel, monkeypatch, dtype):
    """SAT logits equal the ops' to the precision's rounding, also after B is trained in place (the kernel reads
    the parameters themselves); standard rows are the base model's, bit for bit; with the kernel off the ops run."""
    sat_model = seven_projection_model(dtype)
    ids, slots = torch.tensor([[5, 7, 9, 1, 1, 1]]), torch.tensor([[-1, -1, -1, 0, 1, 2]])
    calls = []
    counted = type("Counted", (), {"sat_update": lambda self, *a: (calls.append(1), kernel.sat_update(*a))[1]})()
    monkeypatch.setattr(sat_kernel, "compiled", lambda: counted)

    def logits(compiled: bool) -> torch.Tensor:
        monkeypatch.setenv("SDSAT_SAT_KERNEL", "1" if compiled else "0")
        monkeypatch.setattr(sat_kernel, "compiled", (lambda: counted) if compiled else (lambda: None))
        with torch.inference_mode():
            return sat_model.forward(ids, slots).float()

    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    for _ in range(2):
        ops, compiled = logits(False), logits(True)
        assert calls, "the decoding path did not call the compiled update"
        with torch.inference_mode():
            base = sat_model.model(input_ids=ids).logits.float()
        assert torch.equal(compiled[0, :3], base[0, :3])
        assert not torch.allclose(compiled[0, 3:], base[0, 3:], atol=1e-3)  # the SAT rows were updated
        torch.testing.assert_close(compiled, ops, **tolerance)
        calls.clear()
        with torch.no_grad():
            for b in sat_model.adapter.lora_b.values():
                b.mul_(3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_low_rank_update_for_every_shape_it_takes(kernel, dtype, weights):
    """Ranks and widths in whole vectors (1..4 of 16) and not, 1..9 SAT rows (the kernel takes up to 4 side by
    side), weights float32 or bfloat16 whatever the rows' dtype: rows start.. get scale * (x A) B, rows before are
    untouched; float16 weights, or weights not contiguous, are left to PyTorch's ops."""
    gen = torch.Generator().manual_seed(0)
    for inputs, rank, outputs in [(48, 16, 32), (40, 32, 48), (32, 48, 16), (64, 64, 80), (24, 8, 20), (32, 16, 24),
                                  (32, 0, 16)]:
        a = torch.randn(inputs, rank, generator=gen).to(weights)
        b = torch.randn(rank, outputs, generator=gen).to(weights)
        for rows in range(1, 10):
            x = torch.randn(1, rows + 2, inputs, generator=gen).to(dtype)
            out = torch.randn(1, rows + 2, outputs, generator=gen).to(dtype)
            expected = out.float().clone()
            expected[0, 2:] += (x[0, 2:].float() @ a.float()) @ b.float() * 0.5
            assert kernel.sat_update(out, x, 2, a, b, 0.5)
            assert torch.equal(out[0, :2], expected[0, :2].to(dtype))
            tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.01)
            torch.testing.assert_close(out.float(), expected, **tolerance)
    x, out = torch.randn(1, 3, 48).to(dtype), torch.randn(1, 3, 32).to(dtype)
    before = out.clone()
    assert not kernel.sat_update(out, x, 1, torch.randn(48, 16).half(), torch.randn(16, 32).half(), 1.0)
    assert not kernel.sat_update(out, x, 1, torch.randn(16, 48).to(weights).t(), torch.randn(16, 32).to(weights), 1.0)
    assert torch.equal(out, before)


def test_bfloat16_rows_are_rounded_as_torch_rounds_them(kernel):
    """The kernel's float-to-bfloat16 rounding (nearest, ties to even; overflow to infinity; NaN stays NaN) is
    torch's: updates that land between two bfloat16 numbers, below, at and above halfway."""
    base = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 3.0e38, 2.0] * 2)
    delta = torch.tensor([2 ** -8, 3 * 2 ** -8, 2 ** -9, 2 ** -8 + 2 ** -12, -(2 ** -8), -(2 ** -7) - 2 ** -9, 3.0e38,
                          float("nan")] * 2)
    x = torch.ones(1, 2, 16, dtype=torch.bfloat16)
    a = torch.zeros(16, 16)
    a[:, 0] = 1 / 16  # x A = (1, 0, ..., 0) exactly
    b = torch.zeros(16, 16)
    b[0] = delta
    out = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    out[0, 1] = base.to(torch.bfloat16)
    expected = (out[0, 1].float() + delta).to(torch.bfloat16)
    assert kernel.sat_update(out, x, 1, a, b, 1.0)
    assert not torch.equal(expected[:4], torch.ones(4, dtype=torch.bfloat16))  # some round up, some down
    torch.testing.assert_close(out[0, 1], expected, equal_nan=True, atol=0, rtol=0)


def test_greedy_decoding_with_the_compiled_update_is_identical_to_vanilla(kernel, default_engine, monkeypatch):
    """The shipped adapter's drafts through the compiled update on the real model: output identical to vanilla's,
    and drafts accepted (the update is the adapter's, not noise)."""
    monkeypatch.setenv("SDSAT_SAT_KERNEL", "1")
    prompt = "def running_max(values):\n    \"\"\"Return the running maximum of a list.\"\"\"\n"
    vanilla = default_engine.generate(prompt, DecodeConfig(method="vanilla", max_new_tokens=40))
    sdsat = default_engine.generate(prompt, DecodeConfig(method="sdsat", k=3, max_new_tokens=40))
    assert sdsat.token_ids == vanilla.token_ids
    assert len(sdsat.token_ids) / len(sdsat.steps) > 1.3


def test_where_it_cannot_be_built_the_ops_do_the_work(monkeypatch, caplog, tmp_path):
    """A failed build (no compiler, no ninja) is said once in the log and leaves decoding on PyTorch's ops."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("SDSAT_SAT_KERNEL", "1")
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setattr(native, "_folder", lambda digest: tmp_path / digest)  # a machine it was never built on

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    with caplog.at_level("INFO", logger="sdsat.native"):
        assert sat_kernel.build() is None and sat_kernel.build() is None
    assert sat_kernel.compiled() is None and not native.built()
    assert sum("not available here" in r.message for r in caplog.records) == 1
    assert "Ninja is required" in caplog.records[0].getMessage()
    sat_model = seven_projection_model(torch.float32)
    with torch.inference_mode():
        assert torch.isfinite(sat_model.forward(torch.tensor([[5, 7, 1]]), torch.tensor([[-1, 0, 1]]))).all()


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_ones_is_kept(tmp_path):
    """A process killed mid-build leaves torch's lock file, and every later build would wait on it for ever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    assert not native._drop_stale_lock(lock) and lock.exists()  # a build may be running now
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert native._drop_stale_lock(lock) and not lock.exists()
    assert not native._drop_stale_lock(lock)  # none there: nothing to do
