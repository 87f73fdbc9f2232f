"""The launched app on a real localhost server: through gradio_client, and in headless Chromium.

The browser test needs Debian's chromium (`make browser`) and the playwright package; it is skipped
when either is missing. Screenshots go to runs/screens/ (or $SDSAT_SCREENS).
"""

from __future__ import annotations

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
def server(default_engine):
    import app

    app.page.cache.add(default_engine)
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
    assert data["vanilla"]["text"] == data["sdsat"]["text"] and data["vanilla"]["token_ids"] == data["sdsat"]["token_ids"]
    s = data["sdsat"]
    assert s["new_tokens"] == len(s["token_ids"]) and s["forward_passes"] == 2 * s["iterations"]
    assert abs(s["tokens_per_second"] - s["new_tokens"] / s["seconds"]) < 1e-6
    assert data["sequential"] is True and data["settings"]["k"] == 4
    # With prompt lookup on a prompt that repeats itself: still identical, in fewer passes than 2 per iteration.
    pattern = "red, green, blue, red, green, blue, red, green, blue, red,"
    data = client.predict(**(RACE_ARGS | dict(prompt=pattern, max_new_tokens=16, lookup_tokens=6)), api_name="/generate")
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
    for change, message in ((dict(k=0), "k (adaptive tokens per step) must be between 1 and"),
                            (dict(model="../../etc/passwd"), "model must be one of"),
                            (dict(mode="sampling", top_p=2.0), "top-p must be in (0.0, 1.0]"),
                            (dict(max_new_tokens=10**6), "max new tokens must be between 1 and 48"),
                            (dict(lookup_tokens=99), "prompt lookup tokens must be between 0 and 64"),
                            (dict(tree_candidates=-1), "draft tree candidates must be between 0 and 8")):
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


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium: make browser")
def test_browser_race(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    SCREENS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server)
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
        finally:
            browser.close()
    assert (SCREENS / "race.png").stat().st_size > 10_000


def test_browser_race_with_a_draft_tree(server):
    """The Draft tree setting: still identical, a SAT's second choice is named in a token's tooltip, and
    the setting greys out when sampling (trees are greedy only)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server)
            page.get_by_label("Prompt", exact=True).fill('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
            page.locator("#max-new input[type=number]").fill("40")
            page.locator("#tree input[type=number]").fill("2")
            page.locator("#tree input[type=number]").press("Enter")
            page.get_by_role("button", name="Run the race").click()
            page.locator(".check.ok").wait_for(timeout=300_000)
            assert "Identical output: checked" in page.locator(".check.ok").inner_text()
            assert page.locator('#sdsat-out .tok.src-draft[title*="2nd choice"]').count() > 0
            page.get_by_label("sampling").check()
            page.locator("#tree input[type=number]:disabled").wait_for(timeout=10_000)
        finally:
            browser.close()


def test_chromium_and_playwright_are_available():
    """Tells CI apart from a skipped browser test: `make test` installs both."""
    if os.environ.get("CI") or os.environ.get("SDSAT_REQUIRE_BROWSER"):
        assert shutil.which("chromium") and pytest.importorskip("playwright")
