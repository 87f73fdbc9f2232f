"""The time split of a pass (pass_parts.py) and of a decoding loop (bench/pass_split.py), on a tiny model: the
parts add up to the measured time, none is counted twice, and timing them leaves the output and the model as
they were."""

from __future__ import annotations

from sdsat import attention, cpu_kernels, pass_parts, tuning
from sdsat.bench import pass_split
from sdsat.decoding import DecodeConfig, collect, decode
from test_decoding import TOKENIZER, make_sat_model


def test_a_pass_split_adds_up_to_the_pass_and_names_each_part():
    sat_model = make_sat_model("adapter")
    splits = pass_parts.split_passes(sat_model, {"one": ("plain", 1), "four": ("plain", 4), "draft": ("draft", 3)},
                                     context=20, repeats=3)
    for label, split in splits.items():
        assert set(split.parts) == set(pass_parts.PASS_PARTS)
        assert all(v >= 0 for v in split.parts.values())  # "other" too: no part counted twice
        assert abs(sum(split.parts.values()) - split.total_s) < 1e-9
        for part in (pass_parts.PRODUCTS, pass_parts.ATTENTION, pass_parts.NORMS, pass_parts.HEAD):
            assert split.parts[part] > 0, (label, part)
    assert splits["draft"].parts[pass_parts.SAT_UPDATES] > 0 and splits["one"].parts[pass_parts.SAT_UPDATES] == 0


def test_the_split_times_the_row_invariant_forms_and_puts_everything_back():
    sat_model = make_sat_model("adapter")
    model = sat_model.model
    with tuning.trying(sat_model, "float32", form=tuning.INVARIANT):
        assert model.config._attn_implementation == attention.TILED
        before = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
        hooks = list(sat_model.adapter._hooks)
        split = pass_parts.split_passes(sat_model, {"draft": ("draft", 2)}, context=10, repeats=1)["draft"]
        assert split.parts[pass_parts.ATTENTION] > 0 and split.parts[pass_parts.SAT_UPDATES] > 0
        assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == before
        assert sat_model.adapter._hooks == hooks
        assert cpu_kernels.installed_plan(model) is not None


def test_a_decode_split_adds_up_and_leaves_the_output_as_it_was():
    sat_model = make_sat_model("adapter")
    engine = type("Engine", (), {"sat_model": sat_model, "tokenizer": TOKENIZER, "eos_ids": []})()
    prompt = [5, 17, 3, 59, 42]
    splits = {}
    for method in ("vanilla", "sdsat"):
        config = DecodeConfig(method=method, k=2, max_new_tokens=12)
        split, result = pass_split.split_decode(engine, prompt, config)
        assert result.token_ids == collect(decode(sat_model, TOKENIZER, prompt, config, [])).token_ids
        assert set(split.parts) == set(pass_split.LOOP_PARTS)
        assert abs(sum(split.parts.values()) - split.total_s) < 1e-9 and split.parts[pass_split.LOOP] >= 0
        assert split.parts[pass_split.PASSES] > 0 and split.parts[pass_split.CHOOSING] > 0
        splits[method] = (split, result)
    assert splits["sdsat"][0].parts[pass_split.SURGERY] > 0
    bound = pass_split.arithmetic_bound(splits["vanilla"], splits["sdsat"])
    assert bound["bound"] > 0 and bound["measured"] > 0
    assert abs(bound["share_of_bound"] - bound["measured"] / bound["bound"]) < 1e-12


def test_the_forms_summary_compares_one_token_passes_with_the_cheapest_and_drafts_with_a_plain_pass():
    from sdsat.bench import pass_cost

    results = {"tiled": {"plain": {1: 0.040, 4: 0.044}, "draft": {3: 0.055}},
               "per-row": {"plain": {1: 0.032, 4: 0.050}, "draft": {3: 0.066}}}
    summary = pass_cost.forms_summary(results)
    assert "against per-row's (32.0 ms)" in summary
    assert "- tiled: 1.250×; draft pass [t, SAT×3] 1.25× plain 4" in summary
    assert "- per-row: 1.000×; draft pass [t, SAT×3] 1.32× plain 4" in summary


def test_a_part_called_inside_another_counts_for_itself_alone(monkeypatch):
    """A routed product calls the SAT update inside itself: the update's seconds go to the SAT updates alone, the
    product keeps what is left; a part called inside itself (a method calling another) is counted once."""
    clock = [0.0]
    monkeypatch.setattr(pass_parts.timing, "now", lambda device=None: clock[0])

    def spend(seconds, then=None):
        def run():
            clock[0] += seconds
            if then is not None:
                then()
            clock[0] += seconds
        return run

    timer = pass_parts.Timer(device=None)
    update = timer.wrap(pass_parts.SAT_UPDATES, spend(1.0))
    inner_product = timer.wrap(pass_parts.PRODUCTS, spend(0.25))
    product = timer.wrap(pass_parts.PRODUCTS, spend(0.5, then=lambda: (update(), inner_product())))
    product()
    assert timer.seconds == {pass_parts.SAT_UPDATES: 2.0, pass_parts.PRODUCTS: 1.5}
    assert not timer._open


def test_a_suites_bounds_have_a_row_per_prompt_and_the_share_over_them():
    from sdsat.bench.prompts import BenchPrompt

    sat_model = make_sat_model("adapter")
    engine = type("Engine", (), {"sat_model": sat_model, "tokenizer": TOKENIZER, "eos_ids": [],
                                 "encode": staticmethod(lambda text, chat: [5, 17, 3, len(text)])})()
    prompts = [BenchPrompt(0, "ab", "completion", "first"), BenchPrompt(1, "abcd", "chat", "second")]
    configs = {method: DecodeConfig(method=method, k=2, max_new_tokens=8) for method in ("vanilla", "sdsat")}
    text = pass_split.suite_bounds(engine, prompts, configs)
    rows = [line for line in text.splitlines() if line.startswith("| first") or line.startswith("| second")]
    assert len(rows) == 2 and all(row.endswith("% |") for row in rows)
    assert "share of the bound over 2 prompts: median" in text
    assert "over the suite: an iteration costs" in text.splitlines()[-1]


def test_the_suites_iteration_cost_gives_its_speed_up_and_what_more_needs():
    # vanilla: 100 tokens in 5 s (50 ms a token); SDSAT: 100 tokens in 4 s over 25 iterations (160 ms, 4 tokens each)
    line = pass_split.iteration_cost(v_tokens=100, v_seconds=5.0, s_tokens=100, s_seconds=4.0, iterations=25)
    assert "costs 3.20 of vanilla's tokens (160.0 against 50.0 ms) and gives 4.00: 1.25x" in line
    assert "each 0.1x more needs 0.32 more tokens an iteration" in line


def test_a_draft_pass_read_by_the_sampler_head_counts_its_output_head_as_the_pass(monkeypatch):
    """With a sampler head the draft pass returns hidden states and projects its rows afterwards (sat_model.head):
    that projection is the pass's, as it is inside the verify pass's forward, not the loop's Python. On a clock
    that moves only inside the output head, every second is a forward pass's."""
    from test_head import tiny_sat_model

    clock = [0.0]
    monkeypatch.setattr(pass_split.timing, "now", lambda device=None: clock[0])
    sat_model = tiny_sat_model(head=True)
    sat_model.model.lm_head.register_forward_hook(lambda *_: clock.__setitem__(0, clock[0] + 1.0))
    engine = type("Engine", (), {"sat_model": sat_model, "tokenizer": TOKENIZER, "eos_ids": []})()
    split, result = pass_split.split_decode(engine, [5, 1, 3, 6], DecodeConfig(method="sdsat", k=3, max_new_tokens=10))
    assert len(result.steps) >= 2  # draft passes, each projecting its rows after the pass
    assert split.parts[pass_split.PASSES] == split.total_s == 2 * len(result.steps)  # a draft and a verify pass each
    assert split.parts[pass_split.LOOP] == 0
