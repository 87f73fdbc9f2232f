"""Which of the page's events a client can call, and how many at once.

Every event goes through Gradio's queue, and the queue's direct route (`/gradio_api/run/<name>`,
which Gradio leaves open off Spaces and which skips every concurrency limit) is closed. Two
endpoints are public, `/race` and `/generate`; the page's own events (explorer, panes, examples) are
private, so they are missing from the API's description, but a browser must still reach them by
number: they share one small concurrency group, and each is cheap (it renders a stored race).
"""

from __future__ import annotations

import gradio as gr

UI_GROUP = "ui"  # the concurrency group of the page's own events
UI_CONCURRENCY = 4  # page events (a few milliseconds of rendering each) running at once, for all visitors


def close_direct_routes(demo: gr.Blocks, ui_concurrency: int = UI_CONCURRENCY) -> None:
    """Put every event of `demo` on the queue; give the private ones without a group of their own the
    shared page group. Call after the page is wired and before `demo.queue(api_open=False, ...)`.

    Gradio's own events (gr.Examples' example loader) are created unqueued with no option to change it,
    so this sets the events' queue flag after wiring, for all of them at once.
    """
    for fn in demo.fns.values():
        fn.queue = True
        if fn.api_visibility != "public" and fn.concurrency_id == str(id(fn.fn)):  # Gradio's default: a group per event
            fn.concurrency_id = UI_GROUP
            fn.concurrency_limit = ui_concurrency
