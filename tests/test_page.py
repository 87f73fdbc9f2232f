"""The launched app on a real localhost server: through gradio_client, and in headless Chromium.

The browser test needs Debian's chromium (`make browser`) and the playwright package; it is skipped
when either is missing. Screenshots go to runs/screens/ (or $SDSAT_SCREENS).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("SDSAT_MAX_NEW_TOKENS", "48")
os.environ.setdefault("SDSAT_TIME_LIMIT", "240")  # a loaded CI machine must not cut the race short

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENS = Path(os.environ.get("SDSAT_SCREENS", Path(__file__).resolve().parent.parent / "runs" / "screens"))
RACE_ARGS = dict(prompt="def add(a, b):\n", model="smollm2-135m-instruct", chat=False, mode="greedy", k=4,
                 max_new_tokens=10, temperature=1.0, top_p=1.0, top_k=0, seed=0, lookup_tokens=0, tree_candidates=0)


@pytest.fixture(scope="module")
def server(tuned_engine):
    """The app on localhost, its model measured for auto (quickly: see conftest's tuned_engine)."""
    import app

    app.page.cache.add(tuned_engine)
    _, url, _ = app.demo.launch(prevent_thread_lock=True, quiet=True, server_name="127.0.0.1", **app.LAUNCH_OPTIONS)
    try:
        yield url
    finally:
        app.demo.close()


def test_generate_api_greedy_is_identical_and_adds_up(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    data = client.predict(**RACE_ARGS, api_name="/generate")
    assert data["identical"] is True
    assert (data["vanilla"]["text"] == data["sdsat"]["text"]
            and data["vanilla"]["token_ids"] == data["sdsat"]["token_ids"])
    s = data["sdsat"]
    assert s["new_tokens"] == len(s["token_ids"]) and s["forward_passes"] == 2 * s["iterations"]
    assert abs(s["tokens_per_second"] - s["new_tokens"] / s["seconds"]) < 1e-6
    assert data["sequential"] is True and data["settings"]["k"] == 4
    # Beside the achieved speed-up: the planner's prediction for these settings and what this race's passes imply.
    assert all(0 < data[name] < float("inf") for name in ("predicted_speedup", "implied_speedup"))
    assert data["fastest_vanilla"]["speedup"] > 0 and data["auto"]["plan"]["reason"]
    # With prompt lookup on a prompt that repeats itself: still identical, in fewer passes than 2 per iteration.
    pattern = "red, green, blue, red, green, blue, red, green, blue, red,"
    data = client.predict(**(RACE_ARGS | dict(prompt=pattern, max_new_tokens=16, lookup_tokens=6)),
                          api_name="/generate")
    assert data["identical"] is True and data["settings"]["lookup_tokens"] == 6
    assert data["sdsat"]["forward_passes"] < 2 * data["sdsat"]["iterations"]
    # With a draft tree: still identical, and the settings say so.
    data = client.predict(**(RACE_ARGS | dict(tree_candidates=2)), api_name="/generate")
    assert data["identical"] is True and data["settings"]["tree_candidates"] == 2


def test_race_endpoint_streams_the_page(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    values = [RACE_ARGS[n] for n in ("prompt", "model", "chat", "mode", "k", "max_new_tokens", "temperature",
                                     "top_p", "top_k", "seed")]
    result = client.predict(*values, False, api_name="/race")  # the inputs before prompt lookup's, as they were
    headline, run_data = result[0], result[-1]
    assert "Identical output: checked" in headline and run_data["identical"] is True


def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    for change, message in ((dict(k=0), "k (number of adaptive tokens) must be between 1 and"),
                            (dict(model="../../etc/passwd"), "model must be one of"),
                            (dict(mode="sampling", top_p=2.0), "top_p must be in (0, 1], got 2.0"),
                            (dict(max_new_tokens=10**6), "max_new_tokens must be between 1 and 48, got 1000000"),
                            (dict(lookup_tokens=99), "lookup_tokens must be between 0 (off) and 64, got 99"),
                            (dict(tree_candidates=-1), "tree_candidates must be between 0 (off) and 8, got -1")):
        with pytest.raises(Exception) as info:
            client.predict(**(RACE_ARGS | change), api_name="/generate")
        assert message in str(info.value)
    assert client.predict(**(RACE_ARGS | dict(max_new_tokens=3)), api_name="/generate")["identical"] is True


def test_concurrent_requests_each_get_their_own_result(server, default_engine):
    from gradio_client import Client

    from sdsat.decoding import DecodeConfig

    client = Client(server, verbose=False)
    prompts = ["def add(a, b):\n", "import os\n", "class Point:\n", "The capital of France is"]
    jobs = [client.submit(**(RACE_ARGS | dict(prompt=p, max_new_tokens=4, k=1 + i)), api_name="/generate")
            for i, p in enumerate(prompts)]
    for prompt, job in zip(prompts, jobs):
        data = job.result(timeout=600)
        reference = default_engine.generate(prompt, DecodeConfig(method="vanilla", max_new_tokens=4))
        assert data["identical"] is True and data["sdsat"]["token_ids"] == reference.token_ids


def test_cancelled_race_frees_the_worker(server):
    import time

    from gradio_client import Client

    client = Client(server, verbose=False)
    values = [RACE_ARGS[n] for n in ("prompt", "model", "chat", "mode", "k")] + [48, 1.0, 1.0, 0, 0, False, 0]
    job = client.submit(*values, api_name="/race")
    deadline = time.monotonic() + 120
    while not job.outputs() and time.monotonic() < deadline:  # wait until it streams
        time.sleep(0.2)
    job.cancel()
    start = time.monotonic()
    data = client.predict(**(RACE_ARGS | dict(max_new_tokens=2)), api_name="/generate")
    assert data["identical"] is True
    assert time.monotonic() - start < 60  # not queued behind 48 abandoned tokens of two decoders


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's, driven by Playwright), started once for the module's browser tests."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def _page(browser, server: str, **options):
    """A page of the served demo in a browser context of its own (nothing kept from another test), closed after."""
    context = browser.new_context(**options)
    try:
        page = context.new_page()
        page.goto(server)
        yield page
    finally:
        context.close()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_race(server, browser):
    SCREENS.mkdir(parents=True, exist_ok=True)
    with _page(browser, server, viewport={"width": 1400, "height": 1000}) as page:
        prompt = page.get_by_label("Prompt", exact=True)
        prompt.fill('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
        page.locator("#max-new input[type=number]").fill("40")
        page.get_by_role("button", name="Run the race").click()
        page.locator(".check.ok").wait_for(timeout=300_000)
        assert "Identical output: checked" in page.locator(".check.ok").inner_text()
        assert page.locator("#sdsat-out .tok.src-verified").count() > 0
        assert page.locator("#sdsat-out .tok.src-bonus").count() > 0
        assert page.locator("#vanilla-out .tok").count() > 0
        page.locator("#race-plot .js-plotly-plot").wait_for(timeout=30_000)
        assert page.locator(".js-plotly-plot").count() >= 4
        page.get_by_role("button", name="next ▶").click()
        page.locator("#explorer").get_by_text("Iteration 2 of").wait_for(timeout=10_000)
        page.screenshot(path=str(SCREENS / "race.png"), full_page=True)
        page.locator("#explorer").screenshot(path=str(SCREENS / "explorer.png"))
        page.get_by_label("Show rejected drafts (struck through)").check()
        page.locator("#sdsat-out .tok.src-rejected:visible").first.wait_for(timeout=10_000)  # not a bare newline
        page.locator("#sdsat-out").hover()
        page.locator("#sdsat-out").screenshot(path=str(SCREENS / "sdsat_rejected.png"))

        # Markup in the prompt (and so in the explorer's context) stays text; no handler runs.
        page.evaluate("window.__xss = 0")
        prompt.fill('s = "<i>x</i> & {{7*7}} ${1+1}"  # <img src=x onerror="window.__xss=1">\nprint(')
        page.locator("#max-new input[type=number]").fill("4")
        page.get_by_role("button", name="Run the race").click()
        page.locator("#explorer").get_by_text("print").first.wait_for(timeout=300_000)
        page.locator(".check.ok").wait_for(timeout=60_000)
        assert page.evaluate("window.__xss") == 0
        assert page.locator("#explorer i, #explorer img, #sdsat-out img, #vanilla-out img").count() == 0

        page.get_by_role("tab", name="How it works").click()
        page.locator(".diagram svg").wait_for(timeout=10_000)
        page.screenshot(path=str(SCREENS / "how_it_works.png"), full_page=True)
        page.get_by_role("tab", name="Benchmark").click()
        page.screenshot(path=str(SCREENS / "benchmark.png"), full_page=True)
    assert (SCREENS / "race.png").stat().st_size > 10_000


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_race_with_a_draft_tree(server, browser):
    """The Draft tree setting: still identical, the explorer draws the tree with the SATs' second choices. Under
    sampling the tree stays on, and the step explorer gives every draft's accept test with the run's numbers:
    p, q, min(1, p/q), the uniform number drawn and the verdict, siblings by draw, and the residual after a
    rejection."""
    from playwright.sync_api import expect

    with _page(browser, server, viewport={"width": 1400, "height": 1000}) as page:
        page.get_by_label("Prompt", exact=True).fill('def fibonacci(n):\n'
                                                     '    """Return the n-th Fibonacci number."""\n')
        page.locator("#max-new input[type=number]").fill("40")
        expect(page.locator("#auto-note")).to_contain_text("auto on this machine")  # the page's load has set auto
        for slider, value in (("k", "3"), ("lookup", "0"), ("tree", "2")):  # not auto's: its plan varies by machine
            page.locator(f"#{slider} input[type=number]").fill(value)
            page.locator(f"#{slider} input[type=number]").press("Enter")
        page.get_by_role("button", name="Run the race").click()
        page.locator(".check.ok").wait_for(timeout=300_000)
        assert "Identical output: checked" in page.locator(".check.ok").inner_text()
        nodes = page.locator("#explorer .tree-node")  # the explorer's tree: the chain of 3 and 2 runner-ups
        assert nodes.count() == 5 and nodes.filter(has=page.locator('.chip[title*="2nd choice"]')).count() == 2
        assert page.locator("#explorer .accept-tests").count() == 0  # greedy: no accept test to show

        page.get_by_label("sampling").check()
        page.locator("#tree input[type=number]:enabled").wait_for(timeout=10_000)
        page.locator("#tree input[type=number]").fill("4")
        page.locator("#tree input[type=number]").press("Enter")
        page.get_by_role("button", name="Run the race").click()
        page.locator(".check.info").wait_for(timeout=300_000)
        tests = page.locator("#explorer .accept-tests")
        tests.wait_for(timeout=30_000)
        headers = tests.locator("th").all_inner_texts()
        assert headers[:8] == ["position", "try", "draft x", "p(x)", "q(x)", "min(1, p/q)", "u", "verdict"]
        verdicts, seen_rejection = 0, False
        for iteration in range(2, 14):  # iterations until one has a rejection (its residual shown)
            for row in tests.locator("tr").all()[1:]:
                cells = row.locator("td").all_inner_texts()
                if len(cells) < 8:
                    continue  # the line saying the bonus came from p
                p, q, ratio, u = (float(c.split()[0]) for c in cells[3:7])  # each shown to 3 decimals
                if q >= 0.002:  # the ratio is min(1, p/q) of the unrounded numbers
                    low, high = max(p - 5e-4, 0) / (q + 5e-4), (p + 5e-4) / (q - 5e-4)
                    assert min(1.0, low) - 5e-4 <= ratio <= min(1.0, high) + 5e-4, cells
                assert 0 <= u < 1 and 0 <= ratio <= 1
                if abs(u - ratio) > 1e-3:
                    assert cells[7].strip() == ("✓ accepted" if u < ratio else "✗ rejected"), cells
                verdicts += 1
                if "rejected" in cells[7]:
                    seen_rejection = True
                    assert cells[8].strip(), "a rejection shows its residual"
            if seen_rejection:
                break
            page.get_by_role("button", name="next ▶").click()
            page.locator("#explorer").get_by_text(f"Iteration {iteration} of").wait_for(timeout=10_000)
        assert verdicts and seen_rejection
        assert "draw" in tests.inner_text()  # siblings named by the order they were drawn
        SCREENS.mkdir(parents=True, exist_ok=True)
        page.locator("#explorer").screenshot(path=str(SCREENS / "explorer_sampling.png"))


def test_chromium_and_playwright_are_available():
    """Tells CI apart from a skipped browser test: `make test` installs both."""
    if os.environ.get("CI") or os.environ.get("SDSAT_REQUIRE_BROWSER"):
        assert shutil.which("chromium") and pytest.importorskip("playwright")


# -- issue 18: examples, chat, benchmark chart, replay in the browser, phone width -----------------------


def _open_tab(page, name: str):
    """Click a tab; at phone width Gradio moves the tabs that do not fit into its "More tabs" menu."""
    tab = page.get_by_role("tab", name=name)
    if tab.count():
        tab.click()
    else:
        page.get_by_role("button", name="More tabs").click()
        page.locator(".overflow-dropdown button", has_text=name).click()


def _run_race(page, max_new: str | None = None):
    if max_new is not None:
        page.locator("#max-new input[type=number]").fill(max_new)
        page.locator("#max-new input[type=number]").press("Enter")
    page.evaluate("document.querySelectorAll('.check').forEach((el) => el.classList.add('earlier'))")
    page.get_by_role("button", name="Run the race").click()
    page.locator(".check.ok:not(.earlier)").wait_for(timeout=300_000)  # this race's check, not the last one's


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_default_race_leads_with_auto_and_yields_code(server, browser, tuned_engine):
    """The page opens on a code example and auto, its sliders on this machine's plan; its race gives code, not
    prose, with the predicted speed-up beside the achieved one, and This machine shows the measured pass costs.
    The paper's scheme is one click away, and a chat example asking for a function gives code too."""
    plan = tuned_engine.tuning.plan_for(("two_step",), True)
    expect = pytest.importorskip("playwright.sync_api").expect
    SCREENS.mkdir(parents=True, exist_ok=True)
    with _page(browser, server, viewport={"width": 1440, "height": 1000}) as page:
        assert page.get_by_label("auto (predicted fastest on this machine)").is_checked()
        # The page load fills in the plan; where it keeps a slider's first value, only the note shows it is done.
        expect(page.locator("#auto-note")).to_contain_text(plan.reason, timeout=30_000)
        tree = str(plan.settings.tree_candidates)
        page.wait_for_function(f"document.querySelector('#tree input[type=number]').value === '{tree}'",
                               timeout=30_000)
        _run_race(page)  # the default prompt and settings, as a visitor first sees them
        # The speed-up card, highlighted or not: whether SDSAT won this race depends on the machine's load.
        speedup = page.locator(".headline .card").filter(has=page.locator(".label", has_text="speed-up"))
        assert "predicted" in speedup.inner_text()
        text = page.locator("#sdsat-out .sdsat-out").inner_text()
        assert "return" in text and "\n    " in text, text  # an indented function body
        assert not text.lstrip().startswith("```"), text
        assert page.locator("#sdsat-out .tok.src-copy, #sdsat-out .tok.src-draft").count() > 0
        page.screenshot(path=str(SCREENS / "desktop_race.png"))
        page.get_by_text("This machine: what a forward pass costs here").click()
        page.locator("#machine-plot .js-plotly-plot").wait_for(timeout=30_000)
        assert "ms per one-token pass" in page.locator("#machine").inner_text()
        page.locator("#machine-box").screenshot(path=str(SCREENS / "this_machine.png"))
        page.get_by_label("paper (two-step SATs only)").check()
        page.locator("#tree input[type=number]").wait_for(timeout=5_000)
        page.wait_for_function("document.querySelector('#tree input[type=number]').value === '0'", timeout=10_000)
        assert page.locator("#scheme").get_by_text("paper").count() > 0
        page.get_by_text("prime check: chat request → code").click()
        expect(page.get_by_label("Chat: wrap the prompt in the model's chat template")).to_be_checked()
        _run_race(page)
        assert "def is_prime" in page.locator("#sdsat-out .sdsat-out").inner_text()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_chat_two_turns_coloured_regenerate_replaces_only_the_last(server, browser):
    with _page(browser, server, viewport={"width": 1440, "height": 1000}) as page:
        page.get_by_role("tab", name="Chat").click()
        box = page.locator("#chat-msg textarea")
        done = "#chatbot .chat-turn.turn-{}.run-{} .badge.speed"
        for turn, message in enumerate(["Write a Python function that checks whether a number is prime.",
                                         "Now write one that checks whether a number is even."]):
            box.fill(message)
            page.get_by_role("button", name="Send").click()
            page.locator(done.format(turn, 1)).wait_for(timeout=300_000)
        turns = page.locator("#chatbot .chat-turn")
        assert turns.count() == 2
        for i in range(2):  # both turns keep their colour coding and tooltips
            turn = page.locator(f"#chatbot .chat-turn.turn-{i}")
            assert turn.locator(".tok.src-verified").count() > 0
            assert turn.locator(".tok.src-bonus, .tok.src-draft, .tok.src-copy").count() > 0
            assert "iteration 1" in turn.locator(".tok").first.get_attribute("title")
        assert ("is_prime" in turns.nth(0).inner_text()
                and "identical check: not run yet" in turns.nth(1).inner_text())
        first = turns.nth(0).inner_html()
        page.screenshot(path=str(SCREENS / "desktop_chat.png"))

        page.get_by_role("button", name="↻ Regenerate").click()
        page.locator(done.format(1, 2)).wait_for(timeout=300_000)
        assert page.locator("#chatbot .chat-turn").count() == 2
        assert page.locator("#chatbot .chat-user").count() == 2
        assert page.locator("#chatbot .chat-turn").nth(0).inner_html() == first  # the first turn is untouched
        assert "regenerated" in page.locator("#chatbot .chat-turn.turn-1").inner_text()

        page.get_by_role("button", name="Race this turn against vanilla").click()
        page.locator("#chatbot .chat-turn.turn-1 .badge.ok").wait_for(timeout=300_000)
        assert "identical to vanilla" in page.locator("#chatbot .chat-turn.turn-1 .badge.ok").inner_text()

        page.get_by_role("button", name="Clear conversation").click()
        page.wait_for_function("document.querySelectorAll('#chatbot .chat-turn').length === 0", timeout=10_000)


def test_chat_api_takes_the_history_and_checks_against_vanilla(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    history = [{"role": "user", "content": "Write a Python function that adds two numbers."},
               {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]
    data = client.predict("Now one that multiplies them.", history, max_new_tokens=12, check_vanilla=True,
                          api_name="/chat")
    assert data["identical"] is True and data["sdsat"]["new_tokens"] == len(data["token_ids"]) > 0
    assert data["history"][:2] == history and data["history"][-1] == {"role": "assistant", "content": data["reply"]}
    assert data["left_out_messages"] == 0 and data["settings"]["lookup_tokens"] == 10
    long_history = [{"role": r, "content": "word " * 120} for r in ("user", "assistant") * 4]
    data = client.predict("Hello.", long_history, max_new_tokens=4, api_name="/chat")
    assert data["left_out_messages"] > 0 and "left out" in data["notice"] and data["prompt_tokens"] <= 512
    with pytest.raises(Exception, match="history message 1 must be"):
        client.predict("Hi", [{"role": "robot", "content": "x"}], api_name="/chat")
    with pytest.raises(Exception, match="max_new_tokens must be between 1 and 48, got 500"):
        client.predict("Hi", [], max_new_tokens=500, api_name="/chat")


def _first_current_suite() -> tuple[str, dict]:
    """The Benchmark tab's first current suite (assets/bench/suites.json): its folder and the summary row of its
    paper's-scheme chain (k = 3)."""
    import json

    bench = Path(__file__).resolve().parent.parent / "assets" / "bench"
    folder = json.loads((bench / "suites.json").read_text())["current"][0]["folder"]
    rows = json.loads((bench / folder / "summary.json").read_text())["rows"]
    return folder, next(row for row in rows if row["method"] == "sdsat_greedy k=3")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_benchmark_tab_leads_with_its_chart(server, browser):
    with _page(browser, server, viewport={"width": 1440, "height": 900}) as page:
        page.get_by_role("tab", name="Benchmark").click()
        chart = page.locator("#bench-chart .js-plotly-plot")
        chart.wait_for(timeout=30_000)
        box = chart.bounding_box()
        assert box["y"] + box["height"] <= 900 and box["height"] > 250  # the whole chart on the first screen
        assert "AMD EPYC" in chart.inner_text() and "fastest" in chart.inner_text()
        intro = page.locator("#bench-intro").inner_text()
        assert "measured on AMD EPYC, 2 cores" in intro and "Race tab measures your own run" in intro
        page.screenshot(path=str(SCREENS / "desktop_benchmark.png"))
        assert page.locator(".bench-table:visible").count() == 0  # folded
        folder, chain = _first_current_suite()
        page.get_by_text("HumanEval 16–35, greedy").first.click()  # the first current suite
        table = page.locator(".bench-table:visible").first
        table.wait_for(timeout=10_000)
        speedup, accepted = chain["speed-up vs fastest vanilla (median)"], chain["acceptance by draft position"]
        assert f"{speedup:.2f}×" in table.inner_text()
        assert f"{accepted[0]:.2f} · {accepted[1]:.2f}" in table.inner_text()  # the chain's acceptance, as a list
        assert f"[{accepted[0]}" not in page.locator("body").inner_text()
        files = page.locator("body").inner_text()
        assert f"{folder}-results" in files and f"{folder}-summary" in files  # its files, named by folder
        assert page.get_by_text("HumanEval, all 164 problems").count() == 0 or \
            not page.get_by_text("HumanEval, all 164 problems").first.is_visible()  # older suites: under History
        page.locator("#bench-history").get_by_text("History:").first.click()
        page.get_by_text("HumanEval, all 164 problems").first.wait_for(timeout=10_000)
        assert page.get_by_text("Figures", exact=True).count() == 0  # the empty gallery is gone


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_replay_plays_without_the_server(server, browser):
    """Replay runs in the browser: it sends no request, and the server answers others while it plays."""
    from gradio_client import Client

    with _page(browser, server, viewport={"width": 1440, "height": 1000}) as page:
        _run_race(page, "32")
        sent = []
        page.on("request", lambda request: sent.append(request.url))
        page.get_by_role("button", name="▶ Replay both on one clock, at the measured speed").click()
        page.locator('#replay-status [data-state="playing"]').wait_for(timeout=5_000)
        # Tokens appear again over time; SDSAT's side may already be done playing, vanilla's (slower) is not.
        assert page.locator("#sdsat-out .tok.replay-hidden, #vanilla-out .tok.replay-hidden").count() > 0
        data = Client(server, verbose=False).predict(**(RACE_ARGS | dict(max_new_tokens=2)), api_name="/generate")
        assert data["identical"] is True
        page.locator('#replay-status [data-state="done"]').wait_for(timeout=120_000)
        assert page.locator("#sdsat-out .replay-hidden, #vanilla-out .replay-hidden").count() == 0
        assert "SDSAT" in page.locator("#replay-status").inner_text()
        assert not [url for url in sent if "/queue/" in url or "/run/" in url or "/call/" in url], sent


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_phone_width_has_no_sideways_scroll(server, browser):
    phone = dict(viewport={"width": 390, "height": 844}, device_scale_factor=1, is_mobile=True, has_touch=True)
    with _page(browser, server, **phone) as page:
        _run_race(page, "24")
        page.locator("#race-plot .js-plotly-plot").wait_for(timeout=30_000)
        page.evaluate("document.querySelector('.headline').scrollIntoView()")
        page.screenshot(path=str(SCREENS / "phone_race.png"))
        width = "Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)"
        assert page.evaluate(width) <= 390
        explorer = page.locator("#explorer")
        explorer.scroll_into_view_if_needed()
        assert explorer.bounding_box()["width"] <= 390
        inside = "getComputedStyle(document.querySelector('#explorer .explorer')).overflowX"
        assert page.evaluate(inside) in ("auto", "scroll")  # a wide explorer scrolls within itself
        page.locator("#explorer").screenshot(path=str(SCREENS / "phone_explorer.png"))
        for plot in page.locator(".js-plotly-plot").all():
            assert plot.bounding_box()["width"] <= 390
        for tab in ("Chat", "How it works", "Benchmark"):
            _open_tab(page, tab)
            page.wait_for_timeout(500)
            assert page.evaluate(width) <= 390, tab
        page.screenshot(path=str(SCREENS / "phone_benchmark.png"))
