"""The page's handlers and helpers, called directly (no server): settings, escaping, the race, the explorer."""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import replace

import gradio as gr
import pytest
from conftest import OUR_TAGS, parse_html

from sdsat import tuning
from sdsat.costs import CostCurve, RowCheck
from sdsat.compute import compute_thread
from sdsat.decoding import StepRecord
from sdsat.hardware import hardware_line
from sdsat.models import DEFAULT_MODEL
from sdsat.planner import Settings, predict
from sdsat.ui import explorer, pass_time
from sdsat.ui.handlers import MODEL_OUTPUTS, RACE_OUTPUTS, Page
from sdsat.ui.headline import headline_html
from sdsat.ui.machine import race_costs
from sdsat.ui.presets import AUTO, DEFAULT_SCHEME, FALLBACK, PAGE_SAMPLING, SCHEME_LABELS, auto_settings
from sdsat.ui.race import make_record, race
from sdsat.ui.registry import EngineCache
from sdsat.ui.render import esc, pieces_of, sdsat_html, vanilla_html
from sdsat.ui.settings import REQUEST_INPUTS, Limits, SettingError, parse_request

GOOD = dict(prompt="def add(a, b):\n", model=DEFAULT_MODEL, chat=False, mode="greedy", k=4, max_new_tokens=8,
            temperature=1.0, top_p=1.0, top_k=0, seed=0, lookup_tokens=0, tree_candidates=0)


def check_request(limits: Limits, max_k: int, inputs: dict):
    """What the page does with a request: parse it, then (once the model, here its max_k, is known) check it."""
    request = parse_request(limits, inputs)
    request.validate(limits, max_k)
    return request


@pytest.fixture(scope="module")
def page(default_engine):
    cache = EngineCache(Limits(max_new_tokens=24, time_limit_s=1200))  # a loaded machine must not cut runs short
    cache.add(default_engine)
    return Page(cache.limits, cache)


# -- settings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, named", [
    (dict(k=0), "k (number of adaptive tokens) must be between 1 and 8, got 0"),
    (dict(k=9), "k (number of adaptive tokens) must be between 1 and 8, got 9"),
    (dict(k=2.5), "k (number of adaptive tokens) must be a whole number between 1 and 8, got 2.5"),
    (dict(max_new_tokens=0), "max_new_tokens must be between 1 and 128, got 0"),
    (dict(max_new_tokens=10_000), "max_new_tokens must be between 1 and 128, got 10000"),
    (dict(mode="beam"), "decoding"), (dict(model="gpt2"), "model must be one of"),
    (dict(model="/etc/passwd"), "model must be one of"), (dict(prompt=""), "prompt is empty"),
    (dict(prompt="x" * 9000), "at most 8000 characters"),
    (dict(mode="sampling", temperature=0), "temperature must be in [0.01, 5.0], got 0.0"),
    (dict(mode="sampling", temperature=float("nan")), "temperature must be a number in [0.01, 5.0], got nan"),
    (dict(mode="sampling", temperature=5.5), "temperature must be in [0.01, 5.0], got 5.5"),
    (dict(mode="sampling", top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(mode="sampling", top_p=0), "top_p must be in (0, 1], got 0.0"),
    (dict(mode="sampling", top_k=-1), "top_k must be between 0 (off) and 1000, got -1"),
    (dict(top_k=1001), "top_k must be between 0 (off) and 1000, got 1001"),
    (dict(mode="sampling", seed=-3), "seed must be between 0 and 2147483647, got -3"),
    (dict(mode="sampling", seed=None), "seed must be a whole number between 0 and 2147483647, got None"),
    (dict(seed=2**31), "seed must be between 0 and 2147483647, got 2147483648"),
    (dict(lookup_tokens=65), "lookup_tokens must be between 0 (off) and 64, got 65"),
    (dict(lookup_tokens=-1), "lookup_tokens must be between 0 (off) and 64, got -1"),
    (dict(lookup_tokens="many"), "lookup_tokens must be a whole number between 0 (off) and 64, got 'many'"),
    (dict(tree_candidates=9), "tree_candidates must be between 0 (off) and 8, got 9"),
    (dict(tree_candidates=1.5), "tree_candidates must be a whole number between 0 (off) and 8, got 1.5"),
    # Issue 17: tiny temperatures overflow logits / T; strings are not booleans; any JSON type, any size.
    (dict(mode="sampling", temperature=1e-40), "temperature must be in [0.01, 5.0], got 1e-40"),
    (dict(mode="sampling", temperature=5e-324), "temperature must be in [0.01, 5.0]"),
    (dict(mode="sampling", temperature=10**400), "temperature must be a number in [0.01, 5.0], got a 401-digit number"),
    (dict(temperature="abc"), "temperature must be a number"),  # ignored by greedy, still checked
    (dict(temperature=[1.0]), "temperature must be a number in [0.01, 5.0], got [1.0]"),
    (dict(top_p={"x": 1}), "top_p must be a number in (0, 1], got {'x': 1}"),
    (dict(chat="0"), "chat must be true or false, got '0'"), (dict(chat="no"), "chat must be true or false"),
    (dict(chat={"x": 0}), "chat must be true or false, got {'x': 0}"), (dict(chat=1), "chat must be true or false"),
    (dict(chat=None), "chat must be true or false"),
    (dict(k=10**400), "k (number of adaptive tokens) must be between 1 and 8, got a 401-digit number"),
    (dict(k=-(10**400)), "k (number of adaptive tokens) must be between 1 and 8, got a 401-digit number"),
    (dict(k=1e308), "k (number of adaptive tokens) must be between 1 and 8, got a 309-digit number"),
    (dict(k=[4]), "k (number of adaptive tokens) must be a whole number between 1 and 8, got [4]"),
    (dict(k=True), "k (number of adaptive tokens) must be a whole number between 1 and 8, got True"),
    (dict(seed=float("inf")), "seed must be a whole number between 0 and 2147483647, got inf"),
    (dict(max_new_tokens="NaN"), "max_new_tokens must be a whole number between 1 and 128, got nan"),
    (dict(prompt=["hi"]), "prompt must be text, got ['hi']"), (dict(prompt=None), "prompt must be text"),
    (dict(prompt="a\ud800"), "prompt must be valid Unicode text"),
    (dict(mode=["greedy"]), "mode (decoding) must be one of"), (dict(model=["x"]), "model must be one of"),
    (dict(model={"a": 1}), "model must be one of"),
])
def test_bad_setting_names_the_setting(change, named):
    with pytest.raises(SettingError) as raised:
        check_request(Limits(), 8, (GOOD | change))
    assert named in str(raised.value) and len(str(raised.value)) < 200


def test_settings_parse_strictly_but_accept_what_clients_mean():
    assert check_request(Limits(), 8, (GOOD | dict(chat="false"))).chat is False  # not bool("false")
    assert check_request(Limits(), 8, (GOOD | dict(chat="true"))).chat is True
    config = check_request(Limits(), 8, (GOOD | dict(k=-0.0 + 4, seed=-0.0, lookup_tokens=-0.0))).config
    assert (config.k, config.sampling.seed, config.lookup_tokens) == (4, 0, 0)
    sampled = check_request(Limits(), 8, (GOOD | dict(mode="sampling", temperature="0.01", top_p=1e-300)))
    assert sampled.config.sampling.temperature == 0.01 and sampled.config.sampling.top_p == 1e-300
    assert isinstance(check_request(Limits(), 8, (GOOD | dict(temperature=1))).config.sampling.temperature, float)


def test_the_page_parses_first_and_checks_every_range_once_the_model_is_known(page, monkeypatch):
    # Before the model is loaded only what the page alone knows is checked; k's range needs the model's SATs.
    request = parse_request(Limits(), GOOD | dict(k=99, top_k="5000"))
    assert (request.config.k, request.config.sampling.top_k) == (99, 5000)
    with pytest.raises(SettingError, match=r"k \(number of adaptive tokens\) must be between 1 and 8, got 99"):
        request.validate(Limits(), 8)
    # Greedy runs ignore the sampling settings, and still refuse bad ones.
    with pytest.raises(SettingError, match="top_k must be between 0 .off. and 1000, got 5000"):
        parse_request(Limits(), GOOD | dict(top_k="5000")).validate(Limits(), 8)
    # One check per request: the page validates the decoder's config once, after loading the model.
    from sdsat.config import DecodeConfig

    calls = []
    real = DecodeConfig.validate
    monkeypatch.setattr(DecodeConfig, "validate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    page.prepare(GOOD)
    assert calls == [1]


def test_the_api_handlers_take_the_request_inputs_by_their_names():
    import inspect

    from sdsat.ui.chat import Chat
    from sdsat.ui.handlers import RACE_INPUTS

    def names(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)[1:]

    assert names(Page.generate) == list(REQUEST_INPUTS)  # /generate's schema
    assert names(Page.race) == list(RACE_INPUTS)  # /race's, in the order of app.py's components
    assert set(RACE_INPUTS) == set(REQUEST_INPUTS) | {"show_rejected"}
    assert set(REQUEST_INPUTS) - set(names(Chat.turn)) == {"prompt", "chat"}  # /chat: the message is the prompt


def test_good_settings_fill_both_configs():
    request = check_request(Limits(), 8, (GOOD | dict(mode="sampling", temperature=0.7, top_k="40", seed=3.0)))
    vanilla, sdsat = request.decode_config("vanilla"), request.decode_config("sdsat")
    assert (vanilla.method, sdsat.method, sdsat.k, sdsat.max_new_tokens) == ("vanilla", "sdsat", 4, 8)
    assert sdsat.sampling.do_sample and sdsat.sampling.top_k == 40 and sdsat.sampling.seed == 3
    assert vanilla.sampling is not sdsat.sampling
    assert sdsat.lookup_tokens == 0  # off unless asked
    request = check_request(Limits(), 8, (GOOD | dict(lookup_tokens="6")))
    assert (request.decode_config("sdsat").lookup_tokens, request.decode_config("vanilla").lookup_tokens) == (6, 0)
    assert request.settings()["lookup_tokens"] == 6
    request = check_request(Limits(), 8, (GOOD | dict(tree_candidates=2)))
    assert (request.decode_config("sdsat").tree_candidates, request.decode_config("vanilla").tree_candidates) == (2, 0)
    assert request.settings()["tree_candidates"] == 2 and sdsat.tree_candidates == 0
    sampled = check_request(Limits(), 8, (GOOD | dict(mode="sampling", tree_candidates=2)))
    # A draft tree samples too (multi-draft rejection sampling): the config and the API say so.
    assert sampled.decode_config("sdsat").tree_candidates == sampled.settings()["tree_candidates"] == 2


def test_limits_from_env():
    limits = Limits.from_env({"SDSAT_MODELS": " a, b ,a", "SDSAT_MAX_NEW_TOKENS": "32", "SDSAT_TIME_LIMIT": "12.5"})
    assert limits.models == ["a", "b"] and limits.max_new_tokens == 32 and limits.time_limit_s == 12.5
    assert Limits.from_env({}).models == [DEFAULT_MODEL]
    with pytest.raises(ValueError, match="SDSAT_MAX_NEW_TOKENS"):
        Limits.from_env({"SDSAT_MAX_NEW_TOKENS": "lots"})
    with pytest.raises(ValueError, match="SDSAT_CONCURRENCY must be at least 1"):
        Limits.from_env({"SDSAT_CONCURRENCY": "0"})


def test_cache_refuses_models_off_the_list():
    cache = EngineCache(Limits())
    with pytest.raises(SettingError, match="model must be one of"):
        cache.get("HuggingFaceTB/SmolLM2-360M")


# -- escaping -----------------------------------------------------------------------------------------
HOSTILE = ['<script>alert(1)</script>', ' a < b && c > d', '"quoted" \'single\'', '{{7*7}}', '${1+1}', '`tick`',
           "\x00\x1b"]


def _fake_steps() -> tuple[list[StepRecord], list[str]]:
    common = dict(kind="sat", draft_pass=True, k=3, pass_seconds=[0.1, 0.1])
    steps = [StepRecord(index=0, kv_len_before=5, drafts=[11, 12, 13], draft_probs=[0.9, 0.5, 0.2],
                        predictions=[11, 99, 7, 8], accepted=1, tokens=[10, 11, 99],
                        sources=["verified", "draft", "bonus"], probs=[0.8, 0.7, 0.6], kv_len=8, elapsed=0.2, **common),
             StepRecord(index=1, kv_len_before=8, drafts=[21, 22, 23], draft_probs=[0.9, 0.9, 0.9],
                        predictions=[21, 22, 23, 24], accepted=3, tokens=[20, 21, 22, 23, 24],
                        sources=["verified", "draft", "draft", "draft", "bonus"], probs=[0.5] * 5, kv_len=13,
                        elapsed=0.4, **common)]
    pieces = (HOSTILE + HOSTILE)[:8]
    return steps, pieces


def test_esc_defuses_markup_and_templates():
    out = esc('<script>&"\'{{x}}${y}`')
    assert "<" not in out and ">" not in out and '"' not in out and "{" not in out and "$" not in out
    assert esc("\x00") == "\u2400"


def test_esc_shows_c1_and_bidirectional_controls_as_code_points():
    # A right-to-left override would make the page read differently from the text; U+0085 breaks lines.
    hostile = "a\u202eevil\u202c b\x85c\x9b d\u2066e\u2069 f\u200fg\u061ch\u2028"
    out = esc(hostile)
    assert not any(0x80 <= ord(c) <= 0x9F
                   or c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\u2028\u2029"
                   for c in out), ascii(out)
    assert "\u27e8U+202E\u27e9" in out and "\u27e8U+0085\u27e9" in out and "evil" in out
    steps, _ = _fake_steps()
    assert "\u202e" not in sdsat_html(steps, [hostile] * 8, {}, show_rejected=False)


def test_rendered_panes_show_markup_as_text():
    steps, pieces = _fake_steps()
    vocab = {i: "<img src=x onerror=alert(1)>" for i in range(100)}
    for fragment in (sdsat_html(steps, pieces, vocab, show_rejected=True),
                     vanilla_html([StepRecord(index=i, kind="vanilla", kv_len_before=0, draft_pass=False, k=0,
                                              drafts=[], draft_probs=[], predictions=[], accepted=0, tokens=[i],
                                              sources=["verified"], probs=[0.5], pass_seconds=[0.1], kv_len=1,
                                              elapsed=0.1) for i in range(len(HOSTILE))], HOSTILE)):
        parsed = parse_html(fragment)
        assert parsed.tags <= OUR_TAGS, parsed.tags - OUR_TAGS
        text = "".join(parsed.text)
        assert "<script>alert(1)</script>" in text and "a < b && c > d" in text and "{{7*7}}" in text


def test_sdsat_pane_colours_by_source_and_marks_iterations():
    steps, pieces = _fake_steps()
    html = sdsat_html(steps, pieces, {12: "x", 13: "y"}, show_rejected=True)
    assert html.count('class="iter"') == 2
    assert html.count("src-verified") == 2 and html.count("src-draft") == 4 and html.count("src-bonus") == 2
    assert html.count("src-rejected") == 2  # iteration 1 rejected d2 and d3
    assert "draft position 1 of 3" in html and "not reached: an earlier draft was rejected" in html
    assert "src-rejected" not in sdsat_html(steps, pieces, {}, show_rejected=False)
    # A rejected newline or space is not text: it shows as a visible sign, never as an empty span.
    html = sdsat_html(steps, pieces, {12: "\n", 13: " "}, show_rejected=True)
    rejected = [t for t in parse_html(html).text if t in ("\u21b5", "\u2423")]
    assert sorted(rejected) == ["\u21b5", "\u2423"], parse_html(html).text


def test_pieces_join_to_the_decoded_text(default_engine):
    tok = default_engine.tokenizer
    ids = tok("Grüße 🙂 from 東京 <b>&amp;</b>\n\tok", add_special_tokens=False).input_ids
    pieces = pieces_of(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids)


# -- the race through the handlers ----------------------------------------------------------------------
def test_greedy_race_is_identical_and_stats_add_up(page):
    outs = list(page.race(**(GOOD | dict(max_new_tokens=12)), show_rejected=True))
    final = dict(zip(RACE_OUTPUTS, outs[-1]))
    data, record = final["run_data"], final["record"]
    assert data["identical"] is True and data["vanilla"]["text"] == data["sdsat"]["text"]
    assert data["vanilla"]["token_ids"] == data["sdsat"]["token_ids"]
    s = data["sdsat"]
    assert s["new_tokens"] == len(s["token_ids"]) == sum(len(st.tokens) for st in record.sdsat.steps)
    assert s["forward_passes"] == 2 * s["iterations"]
    assert s["new_tokens"] <= 2 * s["iterations"] + s["mean_accepted_drafts"] * s["iterations"] + 1e-9
    assert data["vanilla"]["forward_passes"] == data["vanilla"]["new_tokens"]
    assert abs(data["speedup"] - s["tokens_per_second"] / data["vanilla"]["tokens_per_second"]) < 1e-9
    assert "Identical output: checked" in final["headline"]
    assert json.dumps(data)  # plain data for the API
    # the explorer draws every iteration
    for i in range(1, s["iterations"] + 1):
        assert f"Iteration {i} of {s['iterations']}" in page.explore(record, i)
    assert page.step(record, s["iterations"], +1)[0] == s["iterations"]


def test_a_race_in_progress_clears_the_last_race_and_sends_no_component_updates(page, monkeypatch):
    """While a race runs, the last race's plots, explorer and record are gone; and after the first snapshot no
    output is a component update (gr.skip() is one), which Gradio answers by building a component and its config
    on the serving thread at every snapshot, taking the CPU from the decoder."""
    from gradio.utils import is_prop_update

    from sdsat.ui import handlers

    monkeypatch.setattr(handlers, "race", functools.partial(race, every=0.01))  # a snapshot at nearly every step
    outs = list(page.race(**(GOOD | dict(max_new_tokens=16)), show_rejected=False))
    running = [dict(zip(RACE_OUTPUTS, out)) for out in outs[:-1]]
    assert len(running) >= 2
    for i, snap in enumerate(running):
        assert snap["record"] is None and snap["run_data"] is None, i
        assert all(snap[p] is None for p in ("race_plot", "accepted_plot", "position_plot", "pass_plot")), i
        assert snap["explorer"] == explorer.RACING
        updates = [name for name, value in snap.items() if is_prop_update(value) or isinstance(value, gr.Slider)]
        assert updates == (["explorer_slider"] if i == 0 else []), (i, updates)
    assert running[0]["explorer_slider"].interactive is False
    final = dict(zip(RACE_OUTPUTS, outs[-1]))
    assert final["record"] is not None and final["run_data"]["identical"] is True


def test_race_with_prompt_lookup_shows_copies_apart_and_stays_identical(page):
    prompt = "red, green, blue, red, green, blue, red, green, blue, red,"  # a pattern the model goes on with
    outs = list(page.race(**(GOOD | dict(prompt=prompt, k=2, max_new_tokens=20, lookup_tokens=6)), show_rejected=True))
    final = dict(zip(RACE_OUTPUTS, outs[-1]))
    data, record = final["run_data"], final["record"]
    assert data["identical"] is True and data["settings"]["lookup_tokens"] == 6
    steps = record.sdsat.steps
    at_once = [i for i, st in enumerate(steps) if st.draft_source == "lookup" and st.forward_passes == 1]
    after_t = [i for i, st in enumerate(steps) if st.draft_source == "lookup" and st.forward_passes == 2]
    assert at_once and after_t and any(steps[i].accepted for i in at_once), [
        (st.draft_source, st.forward_passes) for st in steps]
    assert data["sdsat"]["forward_passes"] == sum(st.forward_passes for st in steps) < 2 * len(steps)
    # The output pane colours accepted copies apart from SAT drafts, and says where they came from.
    pane = final["sdsat"]
    assert "src-copy" in pane and "copied by prompt lookup" in pane
    for i in at_once + after_t:
        html = page.explore(record, i + 1)
        assert "Prompt lookup copied" in html and "copied by prompt lookup" in html
        assert ("draft pass" in html) == (i in after_t)  # copies found before any pass need no draft pass
        assert f"<th>l{steps[i].k}</th>" in html
    figures = {trace.name for trace in final["pass_plot"].data} | {trace.name for trace in final["accepted_plot"].data}
    assert "SDSAT prompt lookup: verify [c, copies]" in figures and "accepted prompt-lookup copies" in figures


def test_race_with_a_draft_tree_stays_identical_and_names_runner_ups(page):
    outs = list(page.race(**(GOOD | dict(prompt="def fibonacci(n):\n", k=3, max_new_tokens=24, tree_candidates=2)),
                          show_rejected=True))
    final = dict(zip(RACE_OUTPUTS, outs[-1]))
    data, record = final["run_data"], final["record"]
    assert data["identical"] is True and data["settings"]["tree_candidates"] == 2
    steps = record.sdsat.steps
    assert all(st.candidates == 5 for st in steps[:-1])  # k = 3 drafts and 2 runner-ups in every verify pass
    taken = [i for i, st in enumerate(steps) if any(st.draft_ranks[:st.accepted])]
    assert taken, [(st.draft_ranks, st.accepted) for st in steps]  # the model took a SAT's second choice
    html = page.explore(record, taken[0] + 1)
    assert "checked 5 candidates (a draft tree" in html and "2nd choice" in html
    # Every candidate is drawn: accepted ones, the first choice the model turned down, those below it.
    assert "Draft tree · every candidate verified" in html
    assert html.count('class="tree-node"') == 5 and 'chip tree-no' in html and 'chip draft' in html
    assert all(t in record.vocab for st in steps for t in st.tree_tokens)  # every candidate has its text


def test_markup_prompt_is_text_everywhere(page):
    prompt = '<script>alert("x")</script> & <b>bold</b>\n<html>\n<head>\n  <title>'
    final = dict(zip(RACE_OUTPUTS,
                     list(page.race(**(GOOD | dict(prompt=prompt, max_new_tokens=8)), show_rejected=True))[-1]))
    for name in ("headline", "vanilla", "sdsat", "explorer"):
        parsed = parse_html(final[name])
        assert parsed.tags <= OUR_TAGS, (name, parsed.tags - OUR_TAGS)
    assert "<title>" in "".join(parse_html(final["explorer"]).text)  # the prompt's tail, shown as text


def test_sampling_race_runs_and_says_why_texts_differ(page):
    outs = list(page.race(**(GOOD | dict(mode="sampling", temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                        max_new_tokens=6)), show_rejected=False))
    final = dict(zip(RACE_OUTPUTS, outs[-1]))
    assert final["run_data"]["identical"] is None and "differ by design" in final["headline"]


def test_bad_input_gives_gr_error_naming_the_setting(page, default_engine):
    with pytest.raises(gr.Error,
                       match=f"k \\(number of adaptive tokens\\) must be between 1 and {default_engine.max_k}, got 50"):
        list(page.race(**(GOOD | dict(k=50)), show_rejected=False))
    with pytest.raises(gr.Error, match="max_new_tokens must be between 1 and 24, got 25"):
        list(page.race(**(GOOD | dict(max_new_tokens=25)), show_rejected=False))
    with pytest.raises(gr.Error, match="prompt must be at most 512 tokens"):
        list(page.race(**(GOOD | dict(prompt="hello " * 600)), show_rejected=False))


def decoders() -> bool:
    """A decoder is running (or waiting) on the compute thread, where the server decodes."""
    return compute_thread().busy


def test_closing_the_run_cancels_the_decoder_at_once(page):
    run = page.race(**(GOOD | dict(max_new_tokens=24)), show_rejected=False)
    next(run)  # the first snapshot: vanilla is decoding
    run.close()  # what Gradio does on Stop or when the visitor leaves
    # The decoder stops at its next iteration boundary: one forward pass, seconds on a loaded 2-core CPU.
    start = time.monotonic()
    while decoders():
        assert time.monotonic() - start < 15
        time.sleep(0.01)
    outs = list(page.race(**GOOD, show_rejected=False))  # the next request works
    assert dict(zip(RACE_OUTPUTS, outs[-1]))["run_data"]["identical"] is True


class SlowPasses:
    """The real engine, with every decoder iteration taking `seconds` longer: a pass on a loaded machine."""

    def __init__(self, engine, seconds: float):
        self.engine, self.seconds = engine, seconds

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, prompt_ids, config, should_stop=None):
        for event in self.engine.stream(prompt_ids, config, should_stop):
            time.sleep(self.seconds)
            yield event


def test_closing_a_race_never_waits_for_the_decoder(default_engine):
    # Gradio closes the generator on its event loop: a join there stalls every visitor for a whole pass.
    request = check_request(Limits(), 8, (GOOD | dict(max_new_tokens=24)))
    ids = default_engine.encode(request.prompt)
    snaps = race(SlowPasses(default_engine, 1.0), ids, request, time_limit_s=600, every=0.01)
    next(snaps)
    start = time.monotonic()
    snaps.close()
    assert time.monotonic() - start < 0.5
    assert decoders()  # still finishing its pass, on the compute thread
    # The next race queues behind it there, so that two decoders never share the CPU.
    snaps = race(default_engine, ids, check_request(Limits(), 8, (GOOD | dict(max_new_tokens=2))), time_limit_s=600)
    assert list(snaps)[-1].phase == "done"


def test_the_pages_thread_takes_a_decodes_steps_in_batches_not_at_every_pass(default_engine, monkeypatch):
    # Each wake-up of the page's thread takes the GIL and a core from the decoder's threads in mid-pass, so it
    # wakes once per `every` seconds (or at the decode's end) and takes what has come since, in order.
    from sdsat.ui import race as race_module

    takes = []
    take = race_module._Inbox.take
    monkeypatch.setattr(race_module._Inbox, "take", lambda self: takes.append(take(self)) or takes[-1])
    request = check_request(Limits(), 8, (GOOD | dict(max_new_tokens=12)))
    ids = default_engine.encode(request.prompt)
    snaps = list(race(default_engine, ids, request, time_limit_s=600, every=600))
    assert [s.phase for s in snaps] == ["done"]  # nothing yielded before a decoder ended
    assert len(takes) == 2  # one take per decoder, of all its events
    for method, events in zip(("vanilla", "sdsat"), takes):
        result = snaps[-1].results[method]
        assert [e for e in events if isinstance(e, StepRecord)] == result.steps == snaps[-1].steps[method]
        assert events[-1] is result and len(result.steps) > 1


def test_a_cancelled_race_never_starts_its_sdsat_phase(default_engine):
    request = check_request(Limits(), 8, (GOOD | dict(max_new_tokens=24)))
    ids = default_engine.encode(request.prompt)
    cancel = threading.Event()
    snaps = race(SlowPasses(default_engine, 0.2), ids, request, time_limit_s=600, cancel=cancel, every=0.01)
    first = next(snaps)
    assert first.phase == "vanilla"
    cancel.set()  # what a cancelled /generate does
    rest = list(snaps)
    assert all(s.phase == "vanilla" for s in rest) and "sdsat" not in first.results
    assert not any(s.steps["sdsat"] for s in rest)
    start = time.monotonic()
    while decoders():  # the vanilla decoder ends at its next iteration; no SDSAT one follows it
        assert time.monotonic() - start < 15
        time.sleep(0.01)


def test_generate_cancelled_raises_instead_of_racing_on(page):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(gr.Error, match="cancelled"):
        page.generate_sync(GOOD, cancel=cancel)


def test_errors_never_show_server_paths(page, default_engine, tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such-model")
    broken = Page(Limits(models=[missing]))
    with pytest.raises(gr.Error) as raised:
        list(broken.race(**(GOOD | dict(model=missing)), show_rejected=False))
    assert ("could not be loaded" in raised.value.message
            and str(tmp_path) not in raised.value.message.replace(missing, ""))
    # A ValueError from deeper down is not an invalid setting: the visitor gets a message, the log the details.
    monkeypatch.setattr(default_engine, "encode",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("/srv/secret/x.json")))
    with pytest.raises(gr.Error) as raised:
        list(page.race(**GOOD, show_rejected=False))
    assert "/srv/secret" not in raised.value.message and raised.value.title == "Server error"


def test_page_events_parse_their_inputs_strictly(page):
    with pytest.raises(gr.Error, match="show rejected drafts must be true or false"):
        page.sdsat_pane(None, "0")
    with pytest.raises(gr.Error, match="show rejected drafts must be true or false"):
        next(page.race(**GOOD, show_rejected={"x": 0}))
    with pytest.raises(gr.Error, match="iteration must be a whole number between 1 and 100000"):
        page.explore(None, "abc")
    with pytest.raises(gr.Error, match="iteration must be"):
        page.step(None, [1], +1)
    assert page.step(None, 1, +1) == (gr.skip(), gr.skip())  # no record: a race runs, or its record expired
    assert page.sdsat_pane(None, True) == gr.skip()
    assert "Run a prompt" in page.explore(None, 7)  # a slider left from a race whose state has expired


def test_time_limit_stops_each_decoder(page, default_engine):
    request = check_request(page.limits, 8, (GOOD | dict(max_new_tokens=24)))
    ids = default_engine.encode(request.prompt)
    snaps = list(race(default_engine, ids, request, time_limit_s=0.02))
    record = make_record(default_engine, request, ids, snaps[-1])
    assert record.time_limited and record.vanilla.stop_reason == "cancelled"
    assert len(record.vanilla.token_ids) < 24 and record.identical()[0]


def test_explorer_without_a_run():
    assert "Run a prompt" in explorer.explorer_html(None, 0)


# -- auto and this machine (issue 15) -----------------------------------------------------------------------
PAPER = next(label for label, key in SCHEME_LABELS.items() if key == "paper")
REPEATING = "red, green, blue, red, green, blue, red, green, blue, red,"  # prompt lookup finds copies in it


def _values(settings: Settings) -> tuple:
    return settings.k, settings.lookup_tokens, settings.tree_candidates


def test_auto_is_the_default_scheme_and_takes_the_machines_plan(page, tuned_engine):
    measured = tuned_engine.tuning
    greedy = measured.plan_for(("two_step",))
    sampled = measured.plan_for(("two_step",), False, **PAGE_SAMPLING)
    assert SCHEME_LABELS[DEFAULT_SCHEME] == AUTO and "sampling at T=" in sampled.reason
    controls = dict(zip(MODEL_OUTPUTS, page.model_controls(DEFAULT_MODEL)))
    assert tuple(controls[n]["value"] for n in ("k", "lookup_tokens", "tree_candidates")) == _values(greedy.settings)
    assert controls["scheme"]["value"] == DEFAULT_SCHEME and esc(greedy.reason) in controls["auto_note"]
    assert page.scheme_controls(DEFAULT_SCHEME, DEFAULT_MODEL, "greedy") == _values(greedy.settings)
    assert page.scheme_controls(DEFAULT_SCHEME, DEFAULT_MODEL, "sampling") == _values(sampled.settings)
    assert page.scheme_label(*_values(greedy.settings), DEFAULT_MODEL, "greedy") == DEFAULT_SCHEME
    assert page.scheme_controls(PAPER, DEFAULT_MODEL, "greedy") == (3, 0, 0)
    if _values(greedy.settings) != (3, 0, 0):
        assert page.scheme_label(3, 0, 0, DEFAULT_MODEL, "greedy") == PAPER
    # Switching to sampling under auto: the plan for the page's sampling settings, a tree if it chose one.
    _, k, lookup, tree = page.mode_controls("sampling", DEFAULT_SCHEME, DEFAULT_MODEL)
    assert (k, lookup, tree) == _values(sampled.settings)
    # The Chat tab's auto decodes with chat's plan (the code plan where the SATs ship no chat trace).
    from sdsat.ui.chat import Chat

    *_, (_, turns, _) = Chat(page.limits, page.cache).respond("Hi.", [], DEFAULT_MODEL, DEFAULT_SCHEME, "greedy",
                                                              1.0, 4)
    config = turns[0].request.config
    chat_plan = measured.plan_for(("two_step",), chat=True)
    assert (config.k, config.lookup_tokens, config.tree_candidates) == _values(chat_plan.settings)


def _with_faster_bfloat16(measured: tuning.Tuning) -> tuning.Tuning:
    """`measured` as if bfloat16 had been measured too: its passes at half the fastest float32 vanilla's (any
    form: on a busy machine the routed form's one-token pass can come out faster than SDSAT's form's), its rows
    moving."""
    curve = measured.curves["float32"]
    scale = 0.5 * min(curve.one_token_s, *measured.vanilla_s.values()) / curve.one_token_s
    faster = CostCurve("bfloat16", {w: scale * s for w, s in curve.plain.items()},
                       {k: scale * s for k, s in curve.draft.items()})
    moving = RowCheck(rows=75, bit_equal=5, argmax_equal=70, max_drift=0.3)
    return replace(measured, curves=measured.curves | {"bfloat16": faster}, rows=measured.rows | {"bfloat16": moving},
                   forms=measured.forms | {"bfloat16": tuning.ROUTED})


def test_this_machine_shows_a_curve_per_precision_and_the_chosen_passes(page, tuned_engine, monkeypatch):
    measured = tuned_engine.tuning
    settings = measured.plan_for(("two_step",), True).settings
    view = page.machine(tuned_engine)
    assert page.machine(tuned_engine) is view  # built once per measurement
    text = "".join(parse_html(view.html).text)
    assert hardware_line(tuned_engine.model) in text and measured.plan_for(("two_step",), True).reason in text
    lines = [t.name for t in view.figure.data if t.mode == "lines+markers"]
    assert [name.split(":")[0] for name in lines] == [measured.names["float32"]]
    chosen = next(t for t in view.figure.data if t.name.startswith("these settings"))
    assert list(chosen.x) == [settings.k + 1, 1 + settings.k + settings.tree_candidates] + (
        [1 + settings.lookup_tokens] if settings.lookup_tokens else [])
    curve = measured.curves["float32"]
    assert list(chosen.y)[:2] == [curve.draft_s(settings.k) / curve.one_token_s,
                                  curve.tree_s(settings.k, settings.tree_candidates) / curve.one_token_s]
    # Two precisions measured: a line each, and the one SDSAT may not use says why.
    monkeypatch.setattr(tuned_engine, "tuning", _with_faster_bfloat16(measured))
    view = page.machine(tuned_engine)
    names = [t.name for t in view.figure.data if t.mode == "lines+markers"]
    assert len(names) == 2 and "bfloat16 routed" in names[1] and "vanilla only" in names[1]
    text = "".join(parse_html(view.html).text)
    assert ("bfloat16 routed: " in text and "(the fastest vanilla here)" in text
            and "5 of 75 rows change their top token when batched" in text)


def test_this_machine_splits_sdsat_passes_and_the_fastest_vanillas_on_request(page, tuned_engine, monkeypatch):
    """The This machine button: each of SDSAT's passes at auto's k in its own form, then the fastest vanilla's
    one-token pass in that one's form (here another float32 form, made the fastest), split into parts that add up
    to the pass; the model is left in SDSAT's form."""
    model = tuned_engine.sat_model.model
    own = f"float32 {tuning.form_of(model)}"
    other = "float32 " + (tuning.PER_ROW if tuning.form_of(model) != tuning.PER_ROW else tuning.INVARIANT)
    monkeypatch.setattr(tuned_engine, "tuning", replace(tuned_engine.tuning, vanilla_s={other: 1e-6}))
    monkeypatch.setattr(pass_time, "REPEATS", 1)
    k = auto_settings(tuned_engine.tuning, True, tuned_engine.max_k)["k"]
    html, figure = page.pass_split(DEFAULT_MODEL)
    assert tuning.form_of(model) == own.partition(" ")[2]
    bars = {trace.name: dict(zip(trace.y, trace.x)) for trace in figure.data}
    assert list(bars) == list(pass_time.PASS_PARTS)
    labels = [f"SDSAT's form ({own}): {label}" for label in ("one token", f"verify, {k + 1} tokens",
                                                           f"draft [t, SAT×{k}]")]
    labels.append(f"the fastest vanilla ({other}): one token")
    assert sorted(bars["attention"]) == sorted(labels)
    table = parse_html(html)
    text = "".join(table.text)
    for label in labels:
        total = sum(parts[label] for parts in bars.values())
        assert label in text and f"{total:.1f}" in text  # the bars add up to the pass's total in the table
        assert all(parts[label] >= 0 for name, parts in bars.items() if name != "other")
        assert (bars["SAT updates"][label] > 0) == ("draft" in label)  # only the draft pass has SAT rows
    monkeypatch.setattr(tuned_engine, "measuring", object())
    html, _ = page.pass_split(DEFAULT_MODEL)
    assert "being measured" in html


def test_race_shows_predicted_and_implied_speedups_beside_the_achieved(page, tuned_engine, monkeypatch):
    measured = tuned_engine.tuning
    settings = dict(prompt=REPEATING, k=3, max_new_tokens=20, lookup_tokens=6, tree_candidates=2)
    final = dict(zip(RACE_OUTPUTS, list(page.race(**(GOOD | settings), show_rejected=False))[-1]))
    data, record = final["run_data"], final["record"]
    assert data["identical"] is True and json.dumps(data)
    # Implied: the race's tokens ÷ its passes priced from the curve, each pass's width read from the records.
    curve = measured.curves["float32"]
    cost = 0.0
    for step in record.sdsat.steps:
        cost += (curve.draft_s(3) if step.draft_pass else 0.0) / curve.one_token_s
        if step.kind == "tree":  # the SAT drafts and their runner-ups, priced as the timed trees say
            cost += curve.tree_s(step.k, len(step.tree_paths) - step.k) / curve.one_token_s
        else:  # SAT drafts or copies
            cost += curve.pass_s(1 + step.k) / curve.one_token_s
    assert data["implied_speedup"] == pytest.approx(data["sdsat"]["new_tokens"] / cost)
    predicted = predict(measured.trace, Settings("two_step", 3, 6, 2), curve, curve.one_token_s).speedup
    assert data["predicted_speedup"] == pytest.approx(predicted)
    for value in (data["implied_speedup"], data["predicted_speedup"]):
        assert 0 < value < float("inf")
    assert (f"predicted {data['predicted_speedup']:.2f}×" in final["headline"]
            and f"its passes imply {data['implied_speedup']:.2f}×" in final["headline"])
    assert data["cost_curve"]["decoding"] == measured.names["float32"] and data["auto"]["plan"] == measured.plan_for(
        ("two_step",), True).to_dict()
    fastest = data["fastest_vanilla"]
    assert fastest["speedup"] == pytest.approx(data["speedup"] * (
        fastest["ms_per_token"] / data["cost_curve"]["one_token_ms"] if fastest["estimated"] else 1))
    # Where another vanilla is faster, the page also gives the speed-up against it, estimated, and names it.
    faster = _with_faster_bfloat16(measured)
    monkeypatch.setattr(tuned_engine, "tuning", faster)
    config = parse_request(page.limits, GOOD | settings).config
    costs = race_costs(tuned_engine, config, record.sdsat, record.speedup)
    assert costs.estimated and costs.fastest == "bfloat16 routed"
    ratio = faster.curves["bfloat16"].one_token_s / measured.curves["float32"].one_token_s
    assert costs.vs_fastest == pytest.approx(record.speedup * ratio)
    headline = headline_html(replace(record, costs=costs))
    assert (f"≈{costs.vs_fastest:.2f}×" in headline and "vs the fastest vanilla here" in headline
            and "bfloat16 routed vanilla" in headline and "estimated from the load-time measurement" in headline)


def test_without_a_trace_auto_keeps_the_defaults_and_says_why(page, tuned_engine, tuning_file, monkeypatch):
    monkeypatch.setattr(tuning, "load_trace", lambda sat_model, name=None: None)  # SATs that ship no acceptance trace
    # The pass costs as tuned_engine measured them (read back from its file): only the plan needs the trace.
    untraced = tuning.tune(tuned_engine.sat_model, tuned_engine.name, fixed_dtype=True, cache_file=tuning_file)
    assert untraced.plan is None and untraced.note
    monkeypatch.setattr(tuned_engine, "tuning", untraced)
    controls = dict(zip(MODEL_OUTPUTS, page.model_controls(DEFAULT_MODEL)))
    assert {n: controls[n]["value"] for n in ("k", "lookup_tokens", "tree_candidates")} == FALLBACK
    assert esc(untraced.note) in controls["auto_note"] and esc(untraced.note) in page.machine(tuned_engine).html
    data = page.generate_sync(GOOD | dict(max_new_tokens=6))
    assert data["predicted_speedup"] is None and data["implied_speedup"] > 0
    assert data["auto"] == {"plan": None, "note": untraced.note, "used": False}


def test_preload_settles_auto_without_measuring_before_the_page(default_engine, monkeypatch):
    """Preload never measures before the page is up: a kept tuning is used at once; without one the machine is
    measured behind the page (`_tune_behind`; its run is tested in test_first_minutes.py)."""
    calls = []
    monkeypatch.setattr("sdsat.ui.registry.Engine.load", lambda config, sats=None: default_engine)
    monkeypatch.setattr(default_engine, "tune", lambda *a, **kw: pytest.fail("measured before the page"))
    monkeypatch.setattr("sdsat.ui.registry.EngineCache._tune_behind",
                        lambda self, engine, remeasure, when_quiet=False: calls.append(remeasure))
    for kept in (tuning.Tuning(), None):  # a clean tuning kept on disk, then none
        monkeypatch.setattr(default_engine, "tuning", kept)
        monkeypatch.setattr(default_engine, "use_stored_tuning", lambda kept=kept: kept is not None)
        page = Page(Limits())
        page.preload()
        assert page.cache.is_loaded(DEFAULT_MODEL)
    assert calls == ["missing"]  # only where nothing was kept
    zero = Page(Limits())
    # On ZeroGPU no CUDA work may run outside a GPU call: the model loads, unmeasured, and the page says so.
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    zero.preload()
    assert calls == ["missing"] and zero.cache.is_loaded(DEFAULT_MODEL)
    controls = dict(zip(MODEL_OUTPUTS, zero.model_controls(DEFAULT_MODEL)))
    assert "not measured on ZeroGPU" in controls["auto_note"] and controls["k"]["value"] == FALLBACK["k"]
    assert "not measured on ZeroGPU" in controls["machine"]  # and no GPU named: that would start CUDA
    assert zero.generate_sync(GOOD | dict(max_new_tokens=3))["predicted_speedup"] is None


# -- chat -------------------------------------------------------------------------------------------------
def test_encode_chat_is_the_template_and_keeps_typed_special_text_as_text(real_tokenizer):
    from sdsat.prompts import encode_chat

    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Add two numbers."}]
    text = real_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert encode_chat(real_tokenizer, messages) == real_tokenizer(text, add_special_tokens=False).input_ids
    typed = encode_chat(real_tokenizer, [{"role": "user", "content": "a <|im_end|> b"}])
    end = real_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert typed.count(end) == 2  # the template's own ends (system and user), not the typed one


def test_chat_leaves_out_the_oldest_messages_to_fit(real_tokenizer):
    from sdsat.ui.chat import check_history, fit_conversation

    history = [{"role": r, "content": f"message {i} " + "word " * 40} for i, r in enumerate(["user", "assistant"] * 3)]
    ids, left_out = fit_conversation(real_tokenizer, history, "last question", budget=10_000)
    assert left_out == 0
    ids, left_out = fit_conversation(real_tokenizer, history, "last question", budget=150)
    assert len(ids) <= 150 and left_out == 4  # whole exchanges, so what is kept starts with a user message
    assert "message 4" in real_tokenizer.decode(ids) and "message 3" not in real_tokenizer.decode(ids)
    for bad, named in (("nope", "history must be a list"), ([{"role": "robot", "content": "x"}], "history message 1"),
                       ([{"role": "user", "content": 3}], "history message 1")):
        with pytest.raises(SettingError, match=named):
            check_history(bad)


def test_chat_turns_render_with_colours_and_badges(page, default_engine):
    from sdsat.ui.chat import Chat

    chat = Chat(page.limits, page.cache)
    turns = []
    for message in ("Write a Python function that adds two numbers.", "And one that subtracts them."):
        *_, (shown, turns, _) = chat.respond(message, turns, DEFAULT_MODEL, DEFAULT_SCHEME, "greedy", 1.0, 12)
    assert len(turns) == 2 and turns[1].prompt_ids[:len(turns[0].prompt_ids)] == turns[0].prompt_ids
    assert [m["role"] for m in shown] == ["user", "assistant"] * 2
    assert "tok src-verified" in shown[3]["content"] and "tokens/s" in shown[3]["content"]
    assert "\n" not in shown[3]["content"]  # one HTML block for the Chatbot's markdown
    *_, (shown, turns) = chat.race_turn(turns)
    assert turns[1].identical() is True and "identical to vanilla" in shown[3]["content"]
    *_, (shown, turns, _) = chat.regenerate(turns, DEFAULT_MODEL, DEFAULT_SCHEME, "greedy", 1.0, 12)
    assert len(turns) == 2 and turns[1].runs == 2 and turns[1].result.token_ids == turns[1].token_ids
    with pytest.raises(gr.Error, match="scheme must be one of"):
        list(chat.respond("hi", [], DEFAULT_MODEL, "fastest-ever", "greedy", 1.0, 12))
    # Stop while a reply decodes: its text so far stays, marked as stopped, and the next turn builds on it.
    replies = chat.respond("Count from one to twenty in words.", turns, DEFAULT_MODEL, "paper", "greedy", 1.0, 24)
    next(replies)
    _, partial, _ = next(replies)
    replies.close()
    shown, turns = chat.stopped(partial)
    assert len(turns) == 3 and turns[2].stopped and "stopped after" in shown[5]["content"]


def test_a_postprocessed_handler_gives_what_gradio_would_and_closes_with_it():
    """The race is wired with postprocess=False and postprocesses its own outputs (events.postprocessed): each
    value as its component would make it, updates and states as they are, and Stop still reaches the handler."""
    import inspect

    import plotly.graph_objects as go

    from sdsat.ui.events import postprocessed

    closed = []
    figure = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))

    def handler(prompt: str, k: int = 3):
        try:
            yield "<b>racing</b>", None, gr.skip(), None, "kept"
            yield "<b>done</b>", figure, gr.Slider(value=1), {"speedup": 1.5, "ids": [1, 2]}, "kept"
        finally:
            closed.append(True)

    outputs = [gr.HTML(render=False), gr.Plot(render=False), gr.Slider(render=False), gr.JSON(render=False),
               gr.State()]
    run = postprocessed(handler, outputs)
    assert inspect.signature(run) == inspect.signature(handler)  # the API's parameter names
    first, second = run("x")
    assert first == ("<b>racing</b>", None, gr.skip(), None, "kept")
    assert second[0] == "<b>done</b>" and isinstance(second[2], gr.Slider) and second[4] == "kept"
    assert second[1] == outputs[1].postprocess(figure).model_dump() and second[1]["type"] == "plotly"
    assert second[3] == {"speedup": 1.5, "ids": [1, 2]}
    assert closed == [True]
    stopped = run("x")
    next(stopped)
    stopped.close()  # Stop, or the visitor leaves
    assert closed == [True, True]


def test_postprocessed_values_reach_the_page_as_gradio_would_send_them():
    """The same raw values through Gradio's own postprocessing and through `postprocessed` with postprocess=False."""
    import asyncio

    import orjson
    import plotly.graph_objects as go
    from gradio.state_holder import SessionState

    from sdsat.ui.events import postprocessed

    with gr.Blocks() as demo:
        outputs = [gr.HTML(), gr.Plot(), gr.Slider(1, 5), gr.JSON(), gr.State(), gr.HTML(), gr.Plot(), gr.JSON()]
        button = gr.Button()
        ours = button.click(lambda: None, None, outputs, postprocess=False)
        gradios = button.click(lambda: None, None, outputs)
    raw = ("<b>x</b>", go.Figure(go.Bar(x=[1], y=[2])), gr.Slider(value=2, interactive=False),
           {"speedup": 1.5, "ids": [1, 2], "nan": float("nan")}, "kept", gr.skip(), None, None)
    wrapped = next(postprocessed(lambda: (v for v in [raw]), outputs)())

    def sent(event, values):  # as the page receives it: JSON, Gradio's models as their data
        out = asyncio.run(demo.postprocess_data(demo.fns[event["id"]], list(values), SessionState(demo)))
        return json.loads(orjson.dumps(out, default=lambda model: model.model_dump()))
    assert sent(ours, wrapped) == sent(gradios, raw)
