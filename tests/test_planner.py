"""The `auto` planner: replays of a trace follow the decoders' rules, and its choice follows the cost curve.

Synthetic curves and traces only (no model): the choice must be deterministic for a given curve,
wide and deep where passes are flat, small where they are steep, and scored against the fastest
vanilla decoding whatever its precision.
"""

import json
import random

import pytest

from sdsat.bench.acceptance import SAMPLED
from sdsat.costs import CostCurve
from sdsat.engine import DEFAULT_ADAPTER
from sdsat.drafters import LookupGate, leading_matches
from sdsat.planner import (MARGIN, MISSED, PRECISION_MARGIN, TRACE_FILE, PromptTrace, SampledAcceptance, Settings,
                           Trace, choose, predict, replay)
from sdsat.tree import MAX_EXTRA, DraftTree
from sdsat.ui.presets import PAGE_SAMPLING


def curve(cost, dtype="float32", one=0.04, sat_overhead=1.1) -> CostCurve:
    """A curve whose pass over w tokens costs one * cost(w); draft passes pay `sat_overhead` on top."""
    plain = {w: one * cost(w) for w in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)}
    return CostCurve(dtype, plain, {k: one * cost(k + 1) * sat_overhead for k in range(1, 9)})


FLAT = lambda w: 1.0  # noqa: E731  (a GPU-like curve)
STEEP = lambda w: float(w)  # noqa: E731  (every row costs a full pass)


def synthetic_trace(seed=0, prompts=6, length=96, depth=6, repeat=False) -> Trace:
    """Ranks drawn per position: the true token is a SAT's first choice less often the deeper it drafts."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(1000) for _ in range(40)]
        output = [rng.randrange(1000) for _ in range(length)]
        if repeat:  # the output copies a stretch of the prompt: prompt lookup finds it
            output[20:50] = prompt[5:35]
        ranks = []
        for n in range(length):
            row = []
            for d in range(1, depth + 1):
                if n + d >= length:
                    break
                r = rng.random()
                first = 0.7 * 0.85 ** (d - 1)
                row.append(0 if r < first else 1 if r < first + 0.15 else 2 if r < first + 0.22 else MISSED)
            ranks.append(row)
        out.append(PromptTrace(prompt, output, ranks))
    return Trace(out, depth)


def test_replay_of_perfect_drafts_counts_the_two_step_tokens():
    """Every draft right: an iteration is a draft pass (1 sure token) and a verify pass (k drafts + bonus)."""
    trace = PromptTrace(list(range(100, 140)), list(range(1000, 1100)), [[0] * 5 for _ in range(100)])
    n, passes, seconds = replay(trace, Settings(k=3), curve(FLAT))
    assert n == 100
    assert passes == 2 * 20  # 100 tokens, 5 per iteration of two passes
    assert seconds == pytest.approx(20 * (0.04 * 1.1 + 0.04))


def test_fused_passes_are_priced_as_timed_and_as_a_draft_block_that_wide_where_not_timed():
    """A fused replay: one draft pass, then one fused pass per iteration of its accepted drafts and bonus, each
    at the curve's timed fused cost; a curve measured before fused passes were timed prices one as a draft
    block of (k + 1)² positions. The timed costs round-trip through the curve's file."""
    trace = PromptTrace(list(range(100, 140)), list(range(1000, 1061)), [[0] * 5 for _ in range(61)])
    untimed = curve(lambda w: 1 + 0.05 * (w - 1))
    timed = curve(lambda w: 1 + 0.05 * (w - 1))
    timed.fused = {2: 0.5}
    for c, fused_s in ((untimed, untimed.draft_s(2) * untimed.pass_s(9) / untimed.pass_s(3)), (timed, 0.5)):
        assert c.fused_s(2) == pytest.approx(fused_s)
        n, passes, seconds = replay(trace, Settings("fused", 2), c)
        assert (n, passes) == (61, 1 + 20)  # the draft pass's t, then 3 tokens per fused pass (2 drafts + bonus)
        assert seconds == pytest.approx(c.draft_s(2) + 20 * fused_s)
    assert CostCurve.from_dict(timed.to_dict()) == timed
    assert CostCurve.from_dict({k: v for k, v in untimed.to_dict().items() if k != "fused"}) == untimed


def test_a_fused_pass_timed_dearer_loses_the_plan_to_the_two_step_scheme():
    """The same trace and curve; only the fused pass's timed cost differs: cheap, the plan is fused; as dear as
    a draft pass and a verify pass together, the two-step scheme's tokens per pass win."""
    trace = synthetic_trace(seed=3)
    cheap, dear = curve(lambda w: 1 + 0.05 * (w - 1)), curve(lambda w: 1 + 0.05 * (w - 1))
    cheap.fused = {k: cheap.draft_s(k) for k in range(1, 7)}
    dear.fused = {k: dear.draft_s(k) + dear.pass_s(k + 1) for k in range(1, 7)}
    assert choose([cheap], trace, max_k=6).settings.scheme == "fused"
    assert choose([dear], trace, max_k=6).settings.scheme == "two_step"


def test_replay_of_wrong_drafts_and_a_runner_up_tree():
    """Drafts that are always the SATs' second choice: the chain gets none, a tree with (1,) gets one per pass."""
    trace = PromptTrace(list(range(100, 140)), list(range(1000, 1060)), [[1] * 3 for _ in range(60)])
    n_chain, passes_chain, _ = replay(trace, Settings(k=3), curve(FLAT))
    n_tree, passes_tree, _ = replay(trace, Settings(k=3, tree_candidates=1), curve(FLAT))
    assert n_chain == n_tree == 60
    assert passes_chain == 2 * 30  # 2 tokens per iteration: the sure token and the bonus
    assert passes_tree == 2 * 20  # 3: the runner-up at depth 1 is accepted too


def test_replay_uses_prompt_lookup_where_the_output_repeats_the_prompt():
    trace = synthetic_trace(repeat=True).prompts[0]
    plain = replay(trace, Settings(k=3), curve(FLAT))
    lookup = replay(trace, Settings(k=3, lookup_tokens=10), curve(FLAT))
    assert lookup[1] < plain[1]  # fewer passes for the same tokens


def test_flat_curve_chooses_deep_drafts_and_a_wide_tree():
    plan = choose([curve(FLAT)], synthetic_trace(), max_k=6)
    assert plan.settings.k >= 3  # a steep curve takes k = 1 (below)
    assert plan.predicted.speedup > 1.5
    assert "predicted" in plan.reason
    two_step = choose([curve(FLAT)], synthetic_trace(), max_k=6, schemes=("two_step",))
    assert two_step.settings.k >= 3 and two_step.settings.tree_candidates >= MAX_EXTRA // 2


def test_steep_curve_chooses_few_drafts_and_says_when_nothing_beats_vanilla():
    plan = choose([curve(STEEP)], synthetic_trace(), max_k=6)
    assert plan.settings.k == 1 and plan.settings.tree_candidates == 0
    assert plan.predicted.speedup < 1
    assert plan.reason.startswith("no setting is predicted to beat vanilla")


def test_moderate_curve_lies_between():
    two_step = ("two_step",)
    moderate = choose([curve(lambda w: 1 + 0.08 * (w - 1))], synthetic_trace(), max_k=6, schemes=two_step).settings
    flat = choose([curve(FLAT)], synthetic_trace(), max_k=6, schemes=two_step).settings
    assert 1 <= moderate.k <= flat.k
    assert moderate.tree_candidates <= flat.tree_candidates


def with_trees(base: CostCurve, node_cost: float, tree_k: int = 3) -> CostCurve:
    """`base` with draft-tree passes timed at depth tree_k: each runner-up costs `node_cost` × a one-token pass
    beyond a plain block as wide."""
    one = base.one_token_s
    base.tree = {e: base.pass_s(1 + tree_k + e) + e * node_cost * one for e in (1, 2, 4, MAX_EXTRA)}
    base.tree_k = tree_k
    return base


def test_tree_pass_cost_is_the_plain_block_plus_the_timed_runner_ups_cost():
    """Measured trees price every tree: a plain block as wide plus the runner-ups' extra cost, interpolated
    between the timed counts and carried on past the widest; without timed trees, the plain block alone."""
    plain = curve(lambda w: 1 + 0.05 * (w - 1))
    assert plain.tree_s(2, 3) == plain.pass_s(6)
    timed = with_trees(curve(lambda w: 1 + 0.05 * (w - 1)), node_cost=0.2)
    one = timed.one_token_s
    for k, extra in ((3, 1), (2, 3), (3, 4), (1, 2)):
        assert timed.tree_s(k, extra) == pytest.approx(timed.pass_s(1 + k + extra) + extra * 0.2 * one)
    assert timed.tree_s(3, 0) == timed.pass_s(4)
    timed.tree[MAX_EXTRA] = timed.pass_s(1 + 3 + MAX_EXTRA)  # as dear as its plain block: the extra cost is 0, not less
    assert timed.tree_s(3, MAX_EXTRA) == pytest.approx(timed.pass_s(1 + 3 + MAX_EXTRA))
    assert CostCurve.from_dict(timed.to_dict()) == timed


def test_runner_ups_that_cost_more_than_they_bring_are_left_out():
    """The same flat curve: free runner-ups make a wide tree pay; runner-ups dear as half a pass each do not,
    and the predicted speed-up counts what the chosen tree costs."""
    two_step, trace = ("two_step",), synthetic_trace()
    free = choose([with_trees(curve(FLAT), 0.0)], trace, max_k=6, schemes=two_step)
    dear = choose([with_trees(curve(FLAT), 0.5)], trace, max_k=6, schemes=two_step)
    assert free.settings.tree_candidates >= MAX_EXTRA // 2
    assert dear.settings.tree_candidates < free.settings.tree_candidates
    assert dear.predicted.speedup < free.predicted.speedup


def test_choice_is_deterministic_for_a_curve():
    trace = synthetic_trace(seed=3)
    curves = [curve(lambda w: 1 + 0.05 * w), curve(lambda w: 1 + 0.02 * w, "bfloat16", one=0.05)]
    first, second = choose(curves, trace, max_k=6), choose(curves, trace, max_k=6)
    assert first.to_dict() == second.to_dict()


def test_baseline_is_the_fastest_vanilla_even_in_an_unusable_precision():
    """bfloat16 vanilla is faster but its rows may not decode SDSAT: SDSAT runs float32 and is scored
    against bfloat16's vanilla, never against the slower float32 one."""
    trace = synthetic_trace()
    fp32, bf16 = curve(FLAT, "float32", one=0.040), curve(FLAT, "bfloat16", one=0.030)
    plan = choose([fp32, bf16], trace, max_k=6, usable={"float32"})
    assert plan.dtype == "float32"
    assert plan.baseline.startswith("bfloat16 vanilla")
    assert plan.predicted.speedup == pytest.approx(plan.predicted.speedup_same_numerics * 0.030 / 0.040)
    alone = predict(trace, plan.settings, fp32, fp32.one_token_s)
    assert plan.predicted.speedup < alone.speedup


def test_usable_precision_that_is_faster_is_chosen():
    trace = synthetic_trace()
    plan = choose([curve(FLAT, "float32", one=0.040), curve(FLAT, "bfloat16", one=0.030)], trace, max_k=6,
                  usable={"float32", "bfloat16"})
    assert plan.dtype == "bfloat16"


def test_another_precision_must_be_predicted_faster_by_the_precision_margin():
    """float32's passes flatter than bfloat16's, its plan predicted faster than bfloat16's by more than MARGIN (no
    tie) but less than PRECISION_MARGIN: the plan decodes in bfloat16, the fastest vanilla's precision; predicted
    faster by more, float32 is chosen. Either way the speed-up reported is the prediction itself."""
    trace = synthetic_trace(seed=3)
    bf16 = curve(lambda w: 1 + 0.05 * (w - 1), "bfloat16", one=0.030)
    for slope, chosen in ((0.03, "bfloat16"), (0.01, "float32")):
        fp32 = curve(lambda w: 1 + slope * (w - 1), "float32", one=0.0305)
        plan = choose([fp32, bf16], trace, max_k=6, usable={"float32", "bfloat16"})
        alone = {c.dtype: choose([fp32, bf16], trace, max_k=6, usable={c.dtype}) for c in (fp32, bf16)}
        gain = alone["float32"].predicted.speedup / alone["bfloat16"].predicted.speedup
        if chosen == "bfloat16":
            assert 1 / (1 - MARGIN) < gain < 1 + PRECISION_MARGIN
        else:
            assert gain > (1 + PRECISION_MARGIN) / (1 - MARGIN)
        assert plan.dtype == chosen and plan.baseline.startswith("bfloat16 vanilla")
        assert plan.predicted == alone[chosen].predicted


def test_a_fused_plan_within_the_margin_loses_to_the_two_step_one_as_narrow():
    """Fused k = 1 and the two-step chain at k = 3 both pass 4 positions at a time; fused predicted a little
    faster (within MARGIN) gives the plan to the two-step scheme, predicted faster beyond it keeps it fused."""
    trace = synthetic_trace(seed=3)
    two_step = choose([curve(lambda w: 1 + 0.05 * (w - 1))], trace, max_k=6, schemes=("two_step",))
    assert two_step.settings == Settings("two_step", 3)
    for gain, scheme in ((1.01, "two_step"), (1.2, "fused")):
        c = curve(lambda w: 1 + 0.05 * (w - 1))
        fused_alone = predict(trace, Settings("fused", 1), c, c.one_token_s)
        c.fused = {1: c.fused_s(1) * fused_alone.speedup / (two_step.predicted.speedup * gain)}
        plan = choose([c], trace, max_k=6, schemes=("two_step", "fused"))
        assert plan.settings.scheme == scheme


def test_sampling_without_a_sampled_acceptance_plans_no_tree():
    """The greedy replay cannot price a sampled tree: without a measured sampled acceptance, no tree."""
    plan = choose([curve(FLAT)], synthetic_trace(), max_k=6, greedy=False)
    assert plan.settings.tree_candidates == 0


def sampled(tries, copies=(0.5,) * 10, temperature=1.0, top_p=1.0, top_k=0, outputs=()) -> SampledAcceptance:
    return SampledAcceptance(temperature, top_p, [list(row) for row in tries], list(copies), top_k, list(outputs))


def test_expected_drafts_of_a_sampled_tree_follow_the_try_order():
    rates = sampled([[0.5, 0.4, 0.2], [0.6, 0.3]])
    assert rates.expected_drafts(DraftTree.for_k(1, 0)) == pytest.approx(0.5)
    # (0,) then (1,): the second try passes 0.4 of the half that reached it
    assert rates.expected_drafts(DraftTree.for_k(1, 1)) == pytest.approx(0.5 + 0.5 * 0.4)
    # chain of 2: 0.5 * (1 + 0.6)
    assert rates.expected_drafts(DraftTree.for_k(2, 0)) == pytest.approx(0.5 * 1.6)
    assert rates.expected_copies(3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_sampling_plans_a_tree_where_later_siblings_pass_and_not_where_they_fail():
    trace = synthetic_trace()
    helpful = sampled([[0.4, 0.5, 0.5, 0.5], [0.4, 0.5, 0.5], [0.4, 0.5], [0.4]])
    useless = sampled([[0.4, 0.0, 0.0, 0.0], [0.4, 0.0, 0.0], [0.4, 0.0], [0.4]], temperature=0.3)
    trace.sampled = [helpful, useless]
    steep_rows = curve(lambda w: 1.0 + 0.02 * (w - 1))  # near-flat: candidates are cheap
    assert choose([steep_rows], trace, max_k=4, greedy=False, temperature=1.0).settings.tree_candidates > 0
    plan = choose([steep_rows], trace, max_k=4, greedy=False, temperature=0.2)  # nearest measured: useless
    assert plan.settings.tree_candidates == 0 and "sampling at T=0.3" in plan.reason


def test_sampled_replay_finds_prompt_lookups_copies_in_the_sampled_output_not_the_greedy_one():
    """Greedy text that repeats the prompt is no evidence that sampled text will: the sampled replay prices
    lookup by the sampled output kept for each prompt, and by the greedy text only where none was kept."""
    trace = synthetic_trace(prompts=3, repeat=True)
    lookup, chain, flat = Settings(k=3, lookup_tokens=10), Settings(k=3), curve(FLAT)
    old = sampled([[0.5], [0.5], [0.5]], copies=[0.9] * 10)
    fresh = sampled([[0.5], [0.5], [0.5]], copies=[0.9] * 10, outputs=[
        [7000 + i for i in range(96)] for _ in trace.prompts])  # tokens the prompts never hold: no copies
    assert predict(trace, lookup, flat, 0.04, old).speedup > predict(trace, chain, flat, 0.04, old).speedup
    assert predict(trace, lookup, flat, 0.04, fresh).speedup == predict(trace, chain, flat, 0.04, fresh).speedup
    # a sampled output that repeats the prompt gets the copies back
    repeats = sampled([[0.5], [0.5], [0.5]], copies=[0.9] * 10, outputs=[p.output_ids for p in trace.prompts])
    assert predict(trace, lookup, flat, 0.04, repeats).speedup == predict(trace, lookup, flat, 0.04, old).speedup
    trace.sampled = [fresh]
    assert choose([flat], trace, max_k=3, greedy=False).settings.lookup_tokens == 0
    trace.sampled = [repeats]
    assert choose([flat], trace, max_k=3, greedy=False).settings.lookup_tokens > 0


def test_sampled_acceptance_round_trips_through_the_trace_file(tmp_path):
    trace = synthetic_trace(prompts=2, length=20)
    trace.sampled = [sampled([[0.5, 0.25]], copies=[0.75], temperature=0.7, top_p=0.95, outputs=[[3, 4], [5]]),
                     sampled([[0.6, 0.3]], copies=[0.8], temperature=0.8, top_p=0.95, top_k=50)]
    trace.save(tmp_path / "acceptance.json")
    again = Trace.load(tmp_path / "acceptance.json")
    assert again.sampled == trace.sampled and again.sampled_at(0.7, 0.9) == trace.sampled[0]
    assert again.sampled_at(0.8, 0.95, 40) == trace.sampled[1]


def test_the_nearest_sampled_setting_weighs_temperature_then_top_p_then_top_k():
    trace = synthetic_trace(prompts=1, length=10)
    plain, top_k, hot = (sampled([[0.5]], temperature=0.8, top_p=0.95), sampled([[0.6]], temperature=0.8, top_p=0.95,
                                                                                  top_k=50), sampled([[0.3]]))
    trace.sampled = [plain, top_k, hot]
    assert trace.sampled_at(0.8, 0.95, 50) is top_k and trace.sampled_at(0.8, 0.95, 200) is top_k
    assert trace.sampled_at(0.8, 0.95) is plain and trace.sampled_at(0.8, 0.95, 5000) is plain
    assert trace.sampled_at(1.0, 1.0, 50) is hot  # the temperature decides first
    nucleus, wide = sampled([[0.5]], temperature=0.8, top_p=0.95), sampled([[0.6]], temperature=0.8, top_k=50)
    trace.sampled = [wide, nucleus]
    assert trace.sampled_at(0.8, 0.95, 50) is nucleus  # then top-p
    cool, warm = sampled([[0.5]], temperature=0.7, top_p=0.95), sampled([[0.6]], temperature=0.8, top_p=0.95, top_k=50)
    trace.sampled = [cool, warm, hot]
    assert trace.sampled_at(0.75, 0.95, 50) is warm and trace.sampled_at(0.75, 0.95) is cool  # top-k breaks the tie
    trace.sampled = [plain, top_k, hot]
    # the plan names the setting it was priced at
    plan = choose([curve(FLAT)], trace, max_k=4, greedy=False, temperature=0.8, top_p=0.95, top_k=40)
    assert "T=0.8 top-p 0.95 top-k 50" in plan.reason


def test_the_shipped_trace_measured_the_pages_own_sampling_defaults():
    """auto's sampled plan on the page is priced at exactly the setting the race opens with."""
    page = tuple(PAGE_SAMPLING[name] for name in ("temperature", "top_p", "top_k"))
    assert page in SAMPLED
    shipped = Trace.load(DEFAULT_ADAPTER / TRACE_FILE).sampled_at(**PAGE_SAMPLING)
    assert (shipped.temperature, shipped.top_p, shipped.top_k) == page


def test_the_shipped_chat_trace_replays_chat_prompts_through_the_chat_template():
    """The default adapter ships a chat trace (chat requests plan from it): the chat suite's prompts, greedy and at
    the page's sampling defaults, every output position ranked."""
    from sdsat.bench.prompts import file_prompts
    from sdsat.planner import CHAT_TRACE_FILE

    chat = Trace.load(DEFAULT_ADAPTER / CHAT_TRACE_FILE)
    prompts = file_prompts("assets/prompts/chat.jsonl")
    assert "chat.jsonl" in chat.source and len(chat.prompts) == len(prompts)
    assert all(len(p.ranks) == len(p.output_ids) for p in chat.prompts)
    page = chat.sampled_at(**PAGE_SAMPLING)
    assert (page.temperature, page.top_p, page.top_k) == tuple(PAGE_SAMPLING[n] for n in ("temperature", "top_p",
                                                                                         "top_k"))


def test_a_trace_file_without_top_k_or_sampled_outputs_loads_as_sampled_without_them(tmp_path):
    """Traces measured before top-k and the sampled outputs were recorded still load (and replay over greedy
    text); a trace whose sampled outputs do not pair with its prompts is refused by name."""
    trace = synthetic_trace(prompts=1, length=10)
    trace.sampled = [sampled([[0.5]], temperature=0.7, top_p=0.95)]
    trace.save(tmp_path / "acceptance.json")
    data = json.loads((tmp_path / "acceptance.json").read_text())
    for setting in data["sampled"]:
        del setting["top_k"], setting["outputs"]
    (tmp_path / "acceptance.json").write_text(json.dumps(data))
    assert Trace.load(tmp_path / "acceptance.json").sampled == trace.sampled
    data["sampled"][0]["outputs"] = [[1, 2], [3, 4]]  # two outputs, one prompt
    (tmp_path / "acceptance.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="T=0.7 keeps 2 outputs for 1 prompts; measure it again"):
        Trace.load(tmp_path / "acceptance.json")


def test_trace_round_trips_through_its_file(tmp_path):
    trace = synthetic_trace(prompts=2, length=20)
    trace.save(tmp_path / "acceptance.json")
    again = Trace.load(tmp_path / "acceptance.json")
    assert again.depth == trace.depth
    assert [p.ranks for p in again.prompts] == [p.ranks for p in trace.prompts]
    assert [p.output_ids for p in again.prompts] == [p.output_ids for p in trace.prompts]


def test_chat_requests_plan_from_the_chat_trace_where_one_ships():
    """A tuning with a chat trace beside the code one: chat requests replay it (here its output never repeats
    the prompt and its drafts are worse, so prompt lookup and deep drafts do not pay), code requests keep the code
    plan; without a chat trace chat requests take the code plan."""
    from sdsat.tuning import Tuning

    flat = curve(lambda w: 1 + 0.02 * (w - 1))
    code = synthetic_trace(repeat=True)
    chat = synthetic_trace(seed=5)
    for prompt in chat.prompts:  # SAT 1 right half the time, none deeper
        prompt.ranks = [[0 if (n % 2 and d == 1) else MISSED for d in range(1, len(row) + 1)]
                        for n, row in enumerate(prompt.ranks)]
    plan = choose([flat], code, max_k=6, usable={"float32"})
    tuning = Tuning(curves={"float32": flat}, plan=plan, trace=code, max_k=6)
    assert tuning.plan_for(("two_step",), chat=True) is plan  # no chat trace: the code plan
    tuning.chat_trace = chat
    chat_plan = tuning.plan_for(("two_step",), chat=True)
    assert chat_plan == choose([flat], chat, max_k=6, usable={"float32"}, schemes=("two_step",),
                               baseline=tuning.baseline, names=tuning.names)
    assert chat_plan.settings.k < plan.settings.k
    assert tuning.plan_for(("two_step",)) is plan
    sampled = tuning.plan_for(("two_step",), greedy=False, chat=True)
    assert sampled.settings.k <= plan.settings.k and sampled is tuning.plan_for(("two_step",), greedy=False, chat=True)


def test_lookup_gate_verifies_what_pays_and_reopens_when_copies_come_right():
    """Before any copies are scored every copy is verified; copies that keep failing are cut to two more than
    their running average right and then not verified at all (without a draft pass below one right, in place of
    the SAT drafts below the drafts' average); copies scored right again, verified or not, turn lookup back on."""
    gate = LookupGate(10, 3)
    assert (gate.length(), gate.pays(direct=True), gate.pays(direct=False)) == (10, True, True)
    gate.saw_copies(4)
    assert gate.length() == 6 and gate.pays(direct=True) and gate.pays(direct=False)  # 4 right >= 3 drafts
    for _ in range(3):
        gate.saw_copies(0)
    assert gate.copies_right == pytest.approx(4 * 0.7 ** 3)
    assert gate.length() == 3 and gate.pays(direct=True) and not gate.pays(direct=False)
    for _ in range(3):
        gate.saw_drafts(0)  # the SAT drafts fail too: copies right 1.37 beat drafts 1.03
    assert gate.pays(direct=False)
    for _ in range(2):
        gate.saw_copies(0)
    assert gate.length() == 2 and not gate.pays(direct=True) and not gate.pays(direct=False)
    for _ in range(4):
        gate.saw_copies(8)
    assert gate.length() == 8 and gate.pays(direct=True) and gate.pays(direct=False)
    assert LookupGate(4, 3).length() == 4 and leading_matches([1, 2, 3], [1, 2, 9, 9]) == 2
    assert leading_matches([1, 2, 3], [1, 2]) == 2 and leading_matches([], [1]) == 0


def test_replay_stops_paying_for_copies_that_keep_failing():
    """An output that never follows its prompt's repeats: lookup finds copies at every recurring pair, all wrong.
    Ungated they would widen pass after pass; gated, the replay costs at most a few passes more than no lookup
    on a steep curve; where the copies are right it still gains
    (test_replay_uses_prompt_lookup_where_the_output_repeats_the_prompt)."""
    rng = random.Random(5)
    prompt = [rng.randrange(1000) for _ in range(200)]
    output = []
    for n in range(40):  # a pair the prompt holds, then a token that never followed it there
        at = rng.randrange(len(prompt) - 2)
        output += [prompt[at], prompt[at + 1], 2000 + n]
    ranks = [[MISSED] * 3 for _ in output]  # no SAT draft right either: two tokens an iteration
    trace = PromptTrace(prompt, output, ranks)
    steep = curve(lambda w: 1 + 0.3 * (w - 1))
    plain = replay(trace, Settings(k=3), steep)[2]
    gated = replay(trace, Settings(k=3, lookup_tokens=10), steep)[2]
    assert all(trace.copies(3 * n + 2, 10) for n in range(39)), "copies after every pair"
    assert gated < plain * 1.1


def test_sampled_replay_stops_paying_for_copies_that_never_pass():
    """Sampled text that repeats the prompt, but copies whose accept tests never pass: the sampled replay, through the
    same gate, stops verifying them, where verifying ten each time would cost a steep curve's wide passes."""
    trace = synthetic_trace(prompts=3, repeat=True)
    steep = curve(lambda w: 1 + 0.3 * (w - 1))
    never = sampled([[0.5], [0.5], [0.5]], copies=[0.0] * 10, outputs=[p.output_ids for p in trace.prompts])
    lookup = predict(trace, Settings(k=3, lookup_tokens=10), steep, 0.04, never).speedup
    assert lookup > 0.95 * predict(trace, Settings(k=3), steep, 0.04, never).speedup
