"""The page's handlers: plain (generator) functions from widget values to widget values.

`app.py` wires them to components; tests call them directly. Per-visitor data travels in and out
through the `record` argument (a gr.State on the page); the only shared object is the read-only
engine cache.
"""

from __future__ import annotations

import threading
from typing import Iterator

import anyio.to_thread
import gradio as gr

from ..decoding import DecodeConfig
from ..models import ModelLoadError
from . import explorer, figures
from .headline import headline_html, progress_html
from .race import RaceRecord, make_record, race
from .registry import EngineCache, max_context
from .render import legend_html, sdsat_html, vanilla_html, waiting_html
from .settings import Limits, RunRequest, SettingError, check_prompt_ids, check_request

# The race's outputs, in the order `Page.run` yields them (app.py lists its components in this order).
RACE_OUTPUTS = ("headline", "vanilla", "sdsat", "race_plot", "accepted_plot", "position_plot", "pass_plot",
                "explorer_slider", "explorer", "record", "run_data")


class Page:
    """Handlers bound to the operator's limits and the shared engine cache."""

    def __init__(self, limits: Limits, cache: EngineCache | None = None):
        self.limits = limits
        self.cache = cache or EngineCache(limits)

    # -- settings ------------------------------------------------------------------------------
    def _engine(self, model: str):
        try:
            return self.cache.get(model)
        except SettingError as err:
            raise gr.Error(str(err), title="Invalid setting") from err
        except ModelLoadError as err:
            raise gr.Error(f"The model {model!r} could not be loaded: {err}", title="Model unavailable") from err

    def k_slider(self, model: str):
        """The k slider for `model`: its range is 1..that model's number of SATs."""
        engine = self._engine(model)
        return gr.Slider(minimum=1, maximum=engine.max_k, step=1, value=min(DecodeConfig.k, engine.max_k))

    def k_slider_if_loaded(self, model: str):
        """On page load: the k range of an already loaded model, without waiting behind running races."""
        return self.k_slider(model) if self.cache.is_loaded(model) else gr.skip()

    def prepare(self, prompt, model, chat, mode, k, max_new_tokens, temperature, top_p, top_k, seed, lookup_tokens=0,
                tree_candidates=0):
        """Check the settings, load the model, encode the prompt: (engine, request, prompt_ids)."""
        settings = dict(prompt=prompt, model=model, chat=chat, mode=mode, k=k, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, lookup_tokens=lookup_tokens,
                        tree_candidates=tree_candidates)
        try:
            check_request(self.limits, None, **settings)
            engine = self._engine(model)
            request = check_request(self.limits, engine.max_k, **settings)
            prompt_ids = engine.encode(request.prompt, chat=request.chat)
            check_prompt_ids(self.limits, prompt_ids, request, max_context(engine))
        except (SettingError, ValueError) as err:
            raise gr.Error(str(err), title="Invalid setting") from err
        return engine, request, prompt_ids

    # -- the race ------------------------------------------------------------------------------
    def run(self, prompt, model, chat, mode, k, max_new_tokens, temperature, top_p, top_k, seed, show_rejected=False,
            lookup_tokens=0, tree_candidates=0) -> Iterator[tuple]:
        """Race vanilla against SDSAT and stream the page; yields tuples in RACE_OUTPUTS order."""
        skip = gr.skip()
        if not self.cache.is_loaded(model) and model in self.limits.models:
            yield (progress_html(None, f"Loading {model}… (first start of a model; later runs begin at once)"),
                   *[skip] * (len(RACE_OUTPUTS) - 1))
        engine, request, prompt_ids = self.prepare(prompt, model, chat, mode, k, max_new_tokens, temperature, top_p,
                                                    top_k, seed, lookup_tokens, tree_candidates)
        special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
        cancel = threading.Event()
        snaps = race(engine, prompt_ids, request, self.limits.time_limit_s, cancel)
        try:
            for snap in snaps:
                if snap.phase != "done":
                    sdsat_pane = (waiting_html("Waiting: SDSAT starts when vanilla has finished.")
                                  if snap.phase == "vanilla" else
                                  sdsat_html(snap.steps["sdsat"], snap.pieces["sdsat"], special_ids=special))
                    yield (progress_html(snap), vanilla_html(snap.steps["vanilla"], snap.pieces["vanilla"], special),
                           sdsat_pane, *[skip] * (len(RACE_OUTPUTS) - 3))
                    continue
                record = make_record(engine, request, prompt_ids, snap)
                yield self.view(record, show_rejected)
        finally:
            cancel.set()  # Stop or a closed page: the decoder stops at its next iteration
            snaps.close()

    def view(self, record: RaceRecord, show_rejected: bool) -> tuple:
        """Every output of a finished race, in RACE_OUTPUTS order."""
        v, s = record.vanilla, record.sdsat
        n = max(len(s.steps), 1)
        return (
            headline_html(record),
            vanilla_html(v.steps, record.pieces["vanilla"], record.special_ids),
            self.sdsat_pane(record, show_rejected),
            figures.race_figure(v.steps, s.steps),
            figures.accepted_figure(s.steps),
            figures.position_figure(s.acceptance_by_position),
            figures.pass_figure(v.steps, s.steps),
            gr.Slider(minimum=1, maximum=max(n, 2), step=1, value=1, interactive=n > 1),  # a slider needs max > min
            explorer.explorer_html(record, 0),
            record,
            record.to_dict(),
        )

    def sdsat_pane(self, record: RaceRecord | None, show_rejected: bool) -> str:
        if record is None:
            return waiting_html("Run a prompt to see the SDSAT output here.")
        return sdsat_html(record.sdsat.steps, record.pieces["sdsat"], record.vocab, bool(show_rejected),
                          record.special_ids)

    # -- after a race: the explorer -----------------------------------------------------
    @staticmethod
    def explore(record: RaceRecord | None, iteration) -> str:
        """The explorer at `iteration` (1-based, as the slider shows it)."""
        return explorer.explorer_html(record, int(iteration or 1) - 1)

    @staticmethod
    def step(record: RaceRecord | None, iteration, delta: int) -> tuple:
        """Move the explorer by `delta` iterations: (slider value, explorer HTML)."""
        n = len(record.sdsat.steps) if record is not None else 1
        i = max(1, min(int(iteration or 1) + delta, n))
        return i, explorer.explorer_html(record, i - 1)

    # -- API -------------------------------------------------------------------------------------
    async def generate(self, prompt: str, model: str = "", chat: bool = False, mode: str = "greedy", k: int = DecodeConfig.k,
                       max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                       seed: int = 0, lookup_tokens: int = 0, tree_candidates: int = 0) -> dict:
        """Race vanilla and SDSAT on one prompt; return both texts, token ids and metrics as JSON.

        `model` is one of the operator's models (empty: the first). `lookup_tokens` > 0 lets SDSAT verify
        up to that many prompt-lookup copies where the text recurs; `tree_candidates` > 0 lets greedy SDSAT
        also verify that many of the SATs' runner-up candidates (a draft tree). Greedy runs report whether the two
        outputs were identical; every decoder stops at the operator's limits.
        """
        cancel = threading.Event()
        try:
            # A cancelled call stops waiting at once and sets `cancel`, so the decoder stops at its next
            # iteration instead of running on for nobody.
            return await anyio.to_thread.run_sync(self.generate_sync, prompt, model, chat, mode, k, max_new_tokens,
                                                  temperature, top_p, top_k, seed, lookup_tokens, tree_candidates, cancel,
                                                  abandon_on_cancel=True)
        finally:
            cancel.set()

    def generate_sync(self, prompt, model, chat, mode, k, max_new_tokens, temperature, top_p, top_k, seed,
                      lookup_tokens=0, tree_candidates=0, cancel: threading.Event | None = None) -> dict:
        """`generate` in the calling thread; setting `cancel` stops it between two iterations."""
        model = model or self.limits.models[0]
        engine, request, prompt_ids = self.prepare(prompt, model, chat, mode, k, max_new_tokens, temperature, top_p,
                                                    top_k, seed, lookup_tokens, tree_candidates)
        cancel = cancel or threading.Event()
        snap = None
        snaps = race(engine, prompt_ids, request, self.limits.time_limit_s, cancel)
        try:
            for snap in snaps:
                pass
        finally:
            cancel.set()
            snaps.close()
        return make_record(engine, request, prompt_ids, snap).to_dict()


def legend() -> str:
    return legend_html()


__all__ = ["Page", "RACE_OUTPUTS", "RunRequest", "legend"]
