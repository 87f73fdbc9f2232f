"""Load-time tuning on this machine's kernels: the row check, precisions tried and restored, bfloat16
greedy identity, and the engine's `auto` settings (planner.py has the synthetic-curve tests)."""

from __future__ import annotations

import json

import pytest
import torch

from sdsat import attention as sdsat_attention
from sdsat import cpu_kernels, tuning
from sdsat.costs import check_rows, measure_curve
from sdsat.decoding import DecodeConfig, collect, decode
from conftest import measure_quickly, quick_curve, tree_seen
from test_decoding import KINDS, TOKENIZER, make_sat_model, random_prompts


def _state(sat_model) -> dict:
    """Parameters and every buffer (the rotary frequencies are not in the state dict)."""
    return {k: v.clone() for m in (sat_model.model, sat_model.adapter) if m is not None
            for k, v in [*m.state_dict().items(), *m.named_buffers()]}


INVARIANT_HERE = pytest.mark.skipif(not cpu_kernels.invariant_available(torch.bfloat16),
                                    reason="no row-invariant bfloat16 products here (oneDNN's or the compiled kernel)")


@INVARIANT_HERE
@pytest.mark.parametrize("form", tuning.EXACT_FORMS)
@pytest.mark.parametrize("precision", tuning.CPU_PRECISIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_row_invariant_forms_are_bit_exact_here_and_sdsat_equals_vanilla_in_them(kind, precision, form):
    """On this machine's kernels, the forms SDSAT decodes in give every row bit for bit as the token alone
    (plain blocks, a draft tree, a draft pass's first row), so greedy SDSAT equals vanilla in that form
    whatever the near-ties: chains, trees, prompt lookup and fused, in float32 and bfloat16."""
    sat_model = make_sat_model(kind)
    with tuning.trying(sat_model, precision, form=form):
        assert tuning.dtype_name(sat_model.model) == precision and tuning.form_of(sat_model.model) == form
        check = check_rows(sat_model)
        if form == tuning.INVARIANT and not check.invariant:  # the tuner then decodes with per-row attention
            pytest.skip(f"tiled attention is not row-invariant on this CPU's kernels ({check.bit_equal} of "
                        f"{check.rows} rows bit-equal): SDSAT decodes in the per-row form here")
        assert check.rows > 60 and check.invariant and check.max_drift == 0, check
        for prompt in random_prompts(seed=7, count=6):
            plain = DecodeConfig(method="vanilla", max_new_tokens=24)
            vanilla = collect(decode(sat_model, TOKENIZER, prompt, plain, []))
            for k in (1, 3, 5):
                for extra in (dict(), dict(tree_candidates=3), dict(lookup_tokens=6), dict(scheme="fused")):
                    config = DecodeConfig(k=k, max_new_tokens=24, **extra)
                    sdsat = collect(decode(sat_model, TOKENIZER, prompt, config, []))
                    assert sdsat.token_ids == vanilla.token_ids, (k, extra, prompt)


@pytest.mark.parametrize("kind", KINDS)
def test_routed_float32_differs_by_rounding_alone(kind):
    """The fallback where no bit-exact form runs: float32's fastest kernels, rows close but not bit-equal."""
    sat_model = make_sat_model(kind)
    with tuning.trying(sat_model, "float32", form=tuning.ROUTED):
        check = check_rows(sat_model)
    assert check.close and check.argmax_equal == check.rows, check


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=INVARIANT_HERE), False])
def test_trying_a_precision_restores_the_model_bit_for_bit(kernels):
    """The model's and the adapter's parameters and buffers come back bit for bit and in their dtype, tied weights
    tied. Without kernels the adapter is converted too (with them it stays in float32)."""
    sat_model = make_sat_model("adapter")
    model = sat_model.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    with torch.no_grad():
        sat_model.adapter.base_embedding.normal_()  # not representable in bfloat16
    plan = cpu_kernels.KernelPlan({tuple(m.weight.shape): ["linear"] * 4 for m in model.modules()
                                   if isinstance(m, torch.nn.Linear)})
    cpu_kernels.install(model, plan)
    before, attention = _state(sat_model), model.config._attn_implementation
    form = tuning.INVARIANT if kernels else tuning.ROUTED
    with tuning.trying(sat_model, "bfloat16", kernels=kernels, form=form):
        if kernels:
            assert model.config._attn_implementation == sdsat_attention.TILED
            assert cpu_kernels.installed_plan(model).invariant
        else:
            assert sat_model.adapter.base_embedding.dtype == torch.bfloat16
        assert next(model.parameters()).dtype == torch.bfloat16
        assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())  # not rounded
    after = _state(sat_model)
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == attention and cpu_kernels.installed_plan(model) is plan


def test_cost_curve_covers_plain_and_draft_blocks_draft_trees_and_fused_passes():
    from sdsat.costs import TREE_EXTRAS, TREE_K

    sat_model = make_sat_model("adapter")
    curve = measure_curve(sat_model, widths=(1, 2, 4), drafts=3, context=16, repeats=1)
    assert set(curve.plain) == {1, 2, 4} and set(curve.draft) == set(curve.fused) == {1, 2, 3}
    assert curve.tree_k == min(TREE_K, sat_model.max_k) and set(curve.tree) == set(TREE_EXTRAS)
    assert all(s > 0 for s in [*curve.plain.values(), *curve.draft.values(), *curve.tree.values(),
                               *curve.fused.values()])
    assert curve.fused_s(2) == curve.fused[2]
    assert curve.pass_s(3) == curve.plain[4] and curve.pass_s(8) == pytest.approx(curve.plain[4] * 2)
    assert measure_curve(sat_model, widths=(1,), drafts=0, context=16, repeats=1, trees=False).tree == {}


def test_engine_plans_auto_settings_from_the_shipped_trace_and_keeps_the_measurement(default_engine, tmp_path,
                                                                                     monkeypatch):
    """The default model ships its acceptance trace: tuning plans, and `auto_config` applies the plan except
    what the caller set; a second tuning reads the disk. (The loaded precision only: other tests share this
    engine, and trying other precisions is tested on tiny models.)"""
    measure_quickly(monkeypatch)
    engine = default_engine
    engine.tuning = None
    cache = tmp_path / "tuning.json"
    try:
        first = tuning.tune(engine.sat_model, engine.name, fixed_dtype=True, cache_file=cache)
        assert first.plan is not None and first.plan.dtype in first.usable == ["float32"]
        assert tuning.form_of(engine.model) == first.forms["float32"]  # the model is left in the chosen form
        engine.tuning = first
        _check_auto_config(engine, first)
        monkeypatch.setattr(tuning, "measure_curve", lambda *a, **kw: pytest.fail("measured again"))
        again = tuning.tune(engine.sat_model, engine.name, fixed_dtype=True, cache_file=cache)
        assert again.to_dict() == first.to_dict()
        assert first.to_dict()["plan"]["reason"]
    finally:  # other tests share this engine as loaded
        tuning.set_precision(engine.sat_model, "float32", form=tuning.ROUTED)
        engine.tuning = None


def _check_auto_config(engine, first):
    config = engine.auto_config(DecodeConfig(max_new_tokens=16))
    assert (config.scheme, config.k, config.lookup_tokens, config.tree_candidates) == (
        first.plan.settings.scheme, first.plan.settings.k, first.plan.settings.lookup_tokens,
        first.plan.settings.tree_candidates)
    mine = engine.auto_config(DecodeConfig(k=1, lookup_tokens=3, max_new_tokens=16),
                              explicit={"k", "lookup_tokens"})
    assert (mine.k, mine.lookup_tokens, mine.scheme) == (1, 3, "two_step")


def test_without_a_trace_auto_keeps_the_given_settings():
    sat_model = make_sat_model("vocab")
    result = tuning.tune(sat_model, "tiny", cache_file=None)
    assert result.plan is None and "no acceptance trace" in result.note
    assert set(result.curves) == set(tuning.CPU_PRECISIONS)


def test_a_tuning_warms_up_once_before_its_first_measurement_and_not_when_the_disk_answers(monkeypatch, tmp_path):
    """A process that has not decoded yet times its passes slower: `python -m sdsat tune` measured the same
    machine slower than the page's start-up, which had decoded before it measured (docs/results.md)."""
    sat_model = make_sat_model("vocab")
    events = []
    measure = tuning._measure
    monkeypatch.setattr(tuning, "_measure", lambda *a, **kw: events.append("measure") or measure(*a, **kw))
    cache = tmp_path / "tuning.json"
    tuning.tune(sat_model, "tiny", cache_file=cache, warm_up=lambda: events.append("warm-up"))
    assert events[0] == "warm-up" and events.count("warm-up") == 1 and "measure" in events
    events.clear()
    tuning.tune(sat_model, "tiny", cache_file=cache, warm_up=lambda: events.append("warm-up"))
    assert events == []


def test_an_engine_warms_up_in_its_fallback_form_before_it_measures(default_engine, monkeypatch):
    """Engine.tune (the command line's, and the page's on its second copy) decodes in the form the model decodes
    in before a tuning exists, and only then measures."""
    forms = []
    monkeypatch.setattr(type(default_engine), "warm_up", lambda engine: forms.append(tuning.form_of(engine.model)))
    monkeypatch.setattr("sdsat.engine.tune", lambda *a, warm_up, **kw: warm_up())
    kept = default_engine.tuning
    default_engine.tuning = None
    try:
        default_engine._tune("all")
    finally:  # other tests share this engine as loaded
        tuning.set_precision(default_engine.sat_model, "float32", form=tuning.ROUTED)
        default_engine.tuning = kept
    invariant = tuning._invariant_forms(default_engine.sat_model, "float32", default_engine.load_config.cpu_kernels)
    assert forms == [tuning.PER_ROW if invariant else tuning.ROUTED]


def _attend(function, query, key, value, seen):
    return function(None, query, key, value, None if seen is None else seen[None, None], 0.125)[0]


@pytest.mark.parametrize("form", [tuning.INVARIANT, tuning.KEYED])
@pytest.mark.parametrize("precision", tuning.CPU_PRECISIONS)
def test_tiled_attention_gives_each_row_as_alone_across_tiles_key_blocks_and_tree_gaps(precision, form):
    """What the tiled and keyed forms rest on, on this machine's kernels: a block's row t equals the same token
    attending alone over its keys, with blocks wider than a tile and key counts on both sides of a KEY_BLOCK
    boundary;
    a tree node (keys with gaps) equals its keys gathered; and the result is attention (close to SDPA's).
    No kernel promises the bit-equality: where a CPU breaks it, the tuner's row check must say so (then
    SDSAT decodes with per-row attention, and this test is skipped)."""
    attend = sdsat_attention.tiled_attention if form == tuning.INVARIANT else sdsat_attention.keyed_attention
    torch.manual_seed(0)
    dtype, heads, kv_heads, dim = getattr(torch, precision), 6, 2, 16
    tile, block = sdsat_attention.TILE_ROWS, sdsat_attention.KEY_BLOCK
    rows, differ = tile + 3, 0
    for cached in (5, block - 4, 2 * block - 1, 2 * block):
        keys = cached + rows
        query = torch.randn(1, heads, rows, dim).to(dtype)
        key, value = (torch.randn(1, kv_heads, keys, dim).to(dtype) for _ in range(2))
        causal = torch.arange(keys)[None, :] <= cached + torch.arange(rows)[:, None]
        for seen in (None, causal):
            out = _attend(attend, query, key, value, seen)
            for t in range(rows):
                n = cached + t + 1
                alone = _attend(attend, query[:, :, t:t + 1], key[:, :, :n],
                                value[:, :, :n], None)
                differ += not torch.equal(out[:, t], alone[:, 0])
        reference = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=causal, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out.float(), reference.transpose(1, 2), atol=2e-2 if dtype != torch.float32
                                   else 1e-5, rtol=1e-2)
    # A draft tree: nodes 4 and 6 are runner-up children of node 1, 5 and 7 of node 2 and 8 of node 4; behind
    # caches whose runner-ups fall in one key block, in two (one batched call each), or fill one exactly.
    parents = [-1, 0, 1, 2, 1, 2, 1, 2, 4]
    for cached in (40, block - 3, block - len(parents)):
        seen = tree_seen(parents, cached)
        query = torch.randn(1, heads, len(parents), dim).to(dtype)
        key, value = (torch.randn(1, kv_heads, seen.shape[1], dim).to(dtype) for _ in range(2))
        out = _attend(attend, query, key, value, seen)
        for node in range(len(parents)):
            index = seen[node].nonzero().squeeze(-1)
            alone = _attend(attend, query[:, :, node:node + 1], key[:, :, index],
                            value[:, :, index], None)
            differ += not torch.equal(out[:, node], alone[:, 0])
    if differ:
        sat_model = make_sat_model("adapter")
        with tuning.trying(sat_model, precision, form=form):
            assert not check_rows(sat_model).invariant, f"{differ} tiled rows differ here, but the row check passed"
        pytest.skip(f"{form} attention is not row-invariant on this CPU's kernels ({differ} rows differ)")


def test_both_forms_soft_cap_scores_as_gemma2_does_and_a_capped_row_is_the_same_alone():
    """Gemma 2 caps attention scores (softcap * tanh(scores / softcap)) before the mask: both forms must too,
    or such a model decodes wrongly; a tiled row stays bit-equal to the same token alone."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    heads, kv_heads, rows, cached, dim, softcap = 4, 2, 5, 70, 8, 2.0
    query = torch.randn(1, heads, rows, dim) * 3  # scores well past the cap
    key, value = torch.randn(1, kv_heads, cached + rows, dim) * 3, torch.randn(1, kv_heads, cached + rows, dim)
    seen = torch.arange(cached + rows)[None, :] <= cached + torch.arange(rows)[:, None]
    additive = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    reference = eager_attention_forward(module, query, key, value, additive, scaling=0.5, softcap=softcap)[0]
    uncapped = eager_attention_forward(module, query, key, value, additive, scaling=0.5)[0]
    assert not torch.allclose(reference, uncapped, atol=1e-3)
    for attend in (sdsat_attention.tiled_attention, sdsat_attention.per_row_attention):
        out = attend(None, query, key, value, seen[None, None], 0.5, softcap=softcap)[0]
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    differ = {}
    for cap in (None, softcap):
        out = sdsat_attention.tiled_attention(None, query, key, value, seen[None, None], 0.5, softcap=cap)[0]
        differ[cap] = sum(not torch.equal(out[:, t], sdsat_attention.tiled_attention(
            None, query[:, :, t:t + 1], key[:, :, :cached + t + 1], value[:, :, :cached + t + 1], None, 0.5,
            softcap=cap)[0][:, 0]) for t in range(rows))
    if differ[None]:  # the kernels are not row-invariant here (see the test above): nothing to compare with
        pytest.skip(f"tiled attention is not row-invariant on this CPU's kernels ({differ[None]} rows differ)")
    assert differ[softcap] == 0


@INVARIANT_HERE
def test_the_tuner_falls_back_to_per_row_attention_when_tiles_are_not_row_invariant(monkeypatch):
    """The tiled form is off the kernels' guarantees: where its row check fails, SDSAT decodes with attention
    one row at a time, and the tiled form's vanilla still counts among the baselines."""
    sat_model = make_sat_model("adapter")
    monkeypatch.setattr(tuning, "measure_curve", quick_curve)
    real_check = tuning.check_rows

    def check(model, *args, **kwargs):
        result = real_check(model, *args, **kwargs)
        if tuning.form_of(model.model) == tuning.INVARIANT:
            result.bit_equal = 0  # as if a kernel of this machine ordered a tile's sums by its shape
        return result

    monkeypatch.setattr(tuning, "check_rows", check)
    measured = tuning._measure(sat_model, "float32", kernels=True, steps=tuning._Steps(0, None))
    assert measured.form == tuning.PER_ROW and measured.rows.invariant
    assert set(measured.others_s) == {tuning.INVARIANT, tuning.ROUTED}


def test_precisions_tried_on_a_cpu_and_elsewhere():
    """On a CPU every CPU precision; elsewhere (a GPU, here the meta device) float32 beside a half-precision
    load, whose batched rows are not close enough for SDSAT there; none beside a fixed dtype."""
    from conftest import make_tiny_llama

    model = make_tiny_llama()
    assert tuning.precisions_to_try(model, fixed=False) == ["float32", "bfloat16"]
    assert tuning.precisions_to_try(model, fixed=True) == ["float32"]
    for dtype, tried in (("bfloat16", ["bfloat16", "float32"]), ("float16", ["float16", "float32"]),
                         ("float32", ["float32"])):
        elsewhere = model.to(device="meta", dtype=getattr(torch, dtype))
        assert tuning.precisions_to_try(elsewhere, fixed=False) == tried
        assert tuning.precisions_to_try(elsewhere, fixed=True) == [dtype]


def test_tiled_attention_cuts_each_pass_anew_for_a_new_mask_of_the_same_shape():
    """Every layer of a pass shares one mask object, so the cut into tiles is kept per mask object: a second
    pass with another mask of the same shape (another tree) must not reuse the first one's cut."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    first = torch.ones(3, 10, dtype=torch.bool).tril(7)[None, None]  # causal behind 7 cached keys
    second = first.clone()
    second[0, 0, 2, 8] = False  # row 2 is a runner-up: it does not see row 1
    attend = sdsat_attention.tiled_attention
    assert torch.equal(attend(None, query, key, value, first, 0.5)[0], attend(None, query, key, value, first, 0.5)[0])
    reused = attend(None, query, key, value, second, 0.5)[0]
    sdsat_attention._LAST = None
    assert torch.equal(reused, attend(None, query, key, value, second, 0.5)[0])
    assert not torch.equal(reused[:, 2], attend(None, query, key, value, first, 0.5)[0][:, 2])


def test_a_noisy_measurement_is_measured_again_and_the_faster_one_kept(monkeypatch, tmp_path):
    """Precisions are measured one after the other: a spell of load slowing one of them must not decide the
    choice. A noisy curve makes every precision measured now go again, in reverse order; each keeps its better
    run (clean before noisy, then faster); a clean first round is not repeated; a curve still noisy is kept,
    marked noisy, so that the next start does not measure it again."""
    from sdsat.costs import CostCurve, RowCheck

    def curve(precision, seconds, spread=1.0):
        return CostCurve(precision, {1: seconds, 2: seconds}, {1: seconds}, spread=spread)

    rows = RowCheck(rows=4, bit_equal=4, argmax_equal=4, max_drift=0.0)
    sat_model = make_sat_model("vocab")
    for script, kept, cached in (
            ({"float32": [0.010, 0.012], "bfloat16": [(0.050, 2.0), 0.008]}, {"float32": 0.010, "bfloat16": 0.008}, 2),
            ({"float32": [0.010], "bfloat16": [0.009]}, {"float32": 0.010, "bfloat16": 0.009}, 2),
            ({"float32": [0.010, 0.011], "bfloat16": [(0.05, 2.0), (0.04, 2.0)]}, {"float32": 0.010, "bfloat16": 0.04},
             2),
            # a faster but noisy second run does not replace a clean first one
            ({"float32": [0.010, (0.008, 2.0)], "bfloat16": [(0.05, 2.0), 0.009]},
             {"float32": 0.010, "bfloat16": 0.009}, 2)):
        calls = []

        def measure(model, precision, kernels, steps, script=script, calls=calls):
            seconds, spread = (lambda v: v if isinstance(v, tuple) else (v, 1.0))(script[precision][
                sum(c == precision for c in calls)])
            calls.append(precision)
            return tuning._Measured(tuning.ROUTED, curve(precision, seconds, spread), rows, {}, spread > 1.5)

        monkeypatch.setattr(tuning, "_measure", measure)
        monkeypatch.setattr(tuning, "REVISIT_ROUNDS", 0)  # the scripted seconds stand (timed again: next test)
        cache = tmp_path / f"tuning-{id(script)}.json"
        measured = tuning.tune(sat_model, "tiny", cache_file=cache)
        assert {p: c.one_token_s for p, c in measured.curves.items()} == kept
        rounds = len(script["float32"])
        assert calls == (["float32", "bfloat16", "bfloat16", "float32"] if rounds == 2 else ["float32", "bfloat16"])
        stored = json.loads(cache.read_text())
        assert len(stored) == cached
        assert sorted(e["noisy"] for e in stored.values()) == sorted(measured.noisy.values())
        assert tuning.tune(sat_model, "tiny", cache_file=cache, remeasure="never").noisy == measured.noisy


@INVARIANT_HERE
def test_every_forms_one_token_pass_is_timed_again_across_the_tuning_and_its_fastest_kept(monkeypatch, tmp_path):
    """A tuning's steps take seconds each, and a shared machine can be slow for as long: after the curves, every
    form's one-token pass is timed again in REVISIT_ROUNDS rounds, precisions in turns (the last measured first),
    and each form keeps its fastest pass of all rounds. SDSAT's form keeps its curve's shape at that level; the
    progress counts these steps too."""
    sat_model = make_sat_model("adapter")
    calls = []
    TIMINGS = {1: 0.030, 2: 0.024, 3: 0.027, 4: 0.029}  # by a form's timing: the fastest neither first nor last

    def measure(sat_model, **kwargs):
        curve = quick_curve(sat_model, **kwargs)
        where = (tuning.dtype_name(sat_model.model), tuning.form_of(sat_model.model))
        again = kwargs.get("repeats") == tuning.REVISIT_PASSES
        calls.append((*where, again))
        if kwargs.get("widths") == (1,):  # another form's one-token step, or a form timed again
            seconds = TIMINGS[sum(c[:2] == where for c in calls)]
            if where == ("float32", tuning.ROUTED) and not again:  # this form's first timing is its fastest
                seconds = 0.020
            curve.plain = {1: seconds}
        else:  # SDSAT's form: its curve, in a slow spell
            curve.plain, curve.draft, curve.tree = {1: 0.040, 2: 0.048, 4: 0.060}, {1: 0.052}, {}
            seconds = 0.036
        curve.fastest_one_s, curve.spread = seconds, 1.0
        return curve

    monkeypatch.setattr(tuning, "measure_curve", measure)
    seen = []
    result = tuning.tune(sat_model, "tiny", cache_file=tmp_path / "tuning.json",
                         on_step=lambda state: seen.append((state.done, state.total)))
    forms = {p: [f for q, f, again in calls if q == p and not again] for p in tuning.CPU_PRECISIONS}
    timed_again = [(p, f) for p, f, again in calls if again]
    assert len(timed_again) == tuning.REVISIT_ROUNDS * sum(len(f) for f in forms.values())
    assert timed_again[0][0] == calls[[again for *_, again in calls].index(True) - 1][0]  # the last measured first
    for precision, measured in forms.items():
        sdsat_form = result.forms[precision]
        for form in measured:  # each form: its first timing, then REVISIT_ROUNDS faster ones; the fastest kept
            assert [again for q, f, again in calls if (q, f) == (precision, form)] == [False] + [
                True] * tuning.REVISIT_ROUNDS
            fastest = 0.020 if (precision, form) == ("float32", tuning.ROUTED) else 0.024
            timed = result.curves[precision].one_token_s if form == sdsat_form else result.vanilla_s[
                f"{precision} {form}"]
            assert timed == pytest.approx(fastest), (precision, form)
        curve = result.curves[precision]
        assert curve.plain[2] / curve.plain[1] == pytest.approx(0.048 / 0.040)  # the curve's shape kept
        assert curve.draft[1] / curve.plain[1] == pytest.approx(0.052 / 0.040)
    assert {total for _, total in seen} == {len(seen)}  # the progress counted every step from the start


def test_a_request_begun_during_a_measurement_step_marks_it_measured_under_load(monkeypatch, tmp_path):
    """The app measures between requests, but a visitor's request may begin while a step runs: the precision
    measured then counts as measured under load, like one slowed by a neighbour (kept, marked noisy, measured
    again when the machine is quiet). Without requests the same measurement is clean."""
    from sdsat.engine import Activity

    sat_model = make_sat_model("vocab")
    for requests, noisy in ((True, True), (False, False)):
        activity = Activity()

        def measure(sat_model, requests=requests, activity=activity, **kwargs):
            if requests:
                with activity.decoding():  # a request begins (and ends) while the step measures
                    pass
            curve = quick_curve(sat_model, **kwargs)
            curve.spread = 1.0  # quiet as far as the timings tell
            return curve

        monkeypatch.setattr(tuning, "measure_curve", measure)
        cache = tmp_path / f"tuning-{requests}.json"
        result = tuning.tune(sat_model, "tiny", cache_file=cache, requests_begun=lambda a=activity: a.begun)
        assert set(result.noisy.values()) == {noisy}
        assert {entry["noisy"] for entry in json.loads(cache.read_text()).values()} == {noisy}
