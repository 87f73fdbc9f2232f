"""Which of the page's events a client can call, and how many at once.

Every event goes through Gradio's queue, and the queue's direct route (`/gradio_api/run/<name>`,
which Gradio leaves open off Spaces and which skips every concurrency limit) is closed. Two
endpoints are public, `/race` and `/generate`; the page's own events (explorer, panes, examples) are
private, so they are missing from the API's description, but a browser must still reach them by
number: they share one small concurrency group, and each is cheap (it renders a stored race).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import gradio as gr
from gradio.utils import is_prop_update
from pydantic import BaseModel

UI_GROUP = "ui"  # the concurrency group of the page's own events
UI_CONCURRENCY = 4  # page events (a few milliseconds of rendering each) running at once, for all visitors
QUEUE_POLL_S = 0.02  # how often the queue looks for a waiting event: the most an event waits to start
PROGRESS_POLL_S = 0.1  # how often, while events run, it looks for progress to send (the page sends none)


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


def calm_queue(demo: gr.Blocks, poll_s: float = QUEUE_POLL_S, progress_poll_s: float = PROGRESS_POLL_S) -> None:
    """Make Gradio's queue poll for work every `poll_s` seconds, not every millisecond. Call after `demo.queue()`.

    On Linux the queue's loop wakes a thousand times a second while idle, and a hundred more while events run.
    Each wake-up takes a core from the decoder's OpenMP workers, which then wait for it at every parallel
    region: on a 2-core machine the decodes a visitor sees ran well below the engine's speed (docs/results.md).
    Gradio has no option for these intervals, so this sets its queue's attributes; tests/test_compute.py counts
    the wake-ups of a served app, so a Gradio that renames them fails there, not silently.
    """
    queue = demo._queue
    queue.sleep_when_free = max(queue.sleep_when_free, poll_s)
    queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, progress_poll_s)


def postprocessed(handler: Callable[..., Iterator[tuple]], outputs: Sequence[gr.components.Component]):
    """`handler`, a generator of output tuples, with each value already postprocessed by its component: wire it
    with `postprocess=False`. Gradio would postprocess every output of every yield on a thread of its pool, one
    hand-over per output, and a streamed race yields several times a second while it decodes. Here it is done
    on the handler's own thread; updates (gr.skip(), a component) and states pass as they are, as Gradio treats
    them. The components are the page's own, not a session's copy: for outputs no event updates in place (the
    race's) the two are the same. The signature stays the handler's (it names the API's parameters).

    The handler wrapped is `zerogpu.gpu`'s where it books a GPU. With `SPACES_GRADIO_AUTO_WRAP` set (opt-in),
    `spaces` may wrap this wrapper again, for its own default duration.
    """
    @functools.wraps(handler)
    def run(*args, **kwargs):
        outs = handler(*args, **kwargs)
        try:
            for values in outs:
                yield tuple(_postprocessed(component, value) for component, value in zip(outputs, values, strict=True))
        finally:
            outs.close()  # Stop or a closed page: the handler's own clean-up runs now, as it would unwrapped

    return run


def _postprocessed(component: gr.components.Component, value):
    if component.stateful or is_prop_update(value) or isinstance(value, gr.blocks.Block):
        return value
    value = component.postprocess(value)
    return value.model_dump() if isinstance(value, BaseModel) else value  # PlotData, JsonData: what Gradio sends
