"""The page's handlers: plain (generator) functions from widget values to widget values.

`app.py` wires them to components; tests call them directly. Per-visitor data travels in and out
through the `record` argument (a gr.State on the page); the only shared object is the read-only
engine cache.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from typing import Iterator, Mapping

import anyio.to_thread
import gradio as gr

from ..compute import compute_thread
from ..decoding import DecodeConfig
from ..engine import Engine
from ..models import ModelLoadError
from . import explorer, figures, pass_time, zerogpu
from .headline import headline_html, progress_html
from .machine import MachineView, auto_line, lines_html, machine_view
from .presets import AUTO, CUSTOM, DEFAULT_SCHEME, SCHEME_LABELS, auto_settings, scheme_of, scheme_settings
from .race import RaceRecord, make_record, race
from .registry import EngineCache, max_context
from .render import esc, sdsat_html, vanilla_html, waiting_html
from .settings import (Limits, SettingError, check_flag, check_iteration, check_prompt_ids, parse_request,
                       request_inputs)

log = logging.getLogger(__name__)

# /race's inputs, in order: the parameters of `Page.race` (Gradio names the API's inputs after them), and
# app.py lists its components in this order. show_rejected comes before lookup_tokens and tree_candidates
# because those two came later: /race callers that send only the earlier inputs keep working.
RACE_INPUTS = ("prompt", "model", "chat", "mode", "k", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
               "show_rejected", "lookup_tokens", "tree_candidates")
# The race's outputs, in the order `Page.race` yields them (app.py lists its components in this order).
RACE_OUTPUTS = ("headline", "vanilla", "sdsat", "race_plot", "accepted_plot", "position_plot", "pass_plot",
                "explorer_slider", "explorer", "record", "run_data")
# What `Page.model_controls` updates, in order (app.py lists its components in this order).
MODEL_OUTPUTS = ("k", "lookup_tokens", "tree_candidates", "scheme", "auto_note", "chat", "chat_examples", "machine",
                 "machine_plot")
SERVER_ERROR = "The server could not complete this request; the error is in its log. Other settings may work."


_SERVER_PATH = re.compile(r"(?<![\w@.~-])/(?:[\w.@~-]+/)*[\w.@~-]+")


def without_paths(text: str) -> str:
    """`text` with absolute file-system paths replaced: a visitor learns what failed, not where files are."""
    return _SERVER_PATH.sub("<server path>", text)


def invalid(err: SettingError) -> gr.Error:
    """A visitor's bad setting, as the visitor sees it; not a server fault, so no traceback in the log."""
    return gr.Error(str(err), title="Invalid setting", print_exception=False)


def visitor_errors(handler):
    """Whatever goes wrong reaches the visitor as a gr.Error with a message, never as Gradio's bare
    `{"error": null}`; the details (which may hold server paths) go to the server's log only."""
    def convert(err: Exception) -> gr.Error:
        log.exception("%s failed", handler.__name__)
        return gr.Error(SERVER_ERROR, title="Server error")

    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def wrapped(*args, **kwargs):
            try:
                yield from handler(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as err:
                raise convert(err) from None
    elif inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def wrapped(*args, **kwargs):
            try:
                return await handler(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as err:
                raise convert(err) from None
    else:
        @functools.wraps(handler)
        def wrapped(*args, **kwargs):
            try:
                return handler(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as err:
                raise convert(err) from None
    return wrapped


class Page:
    """Handlers bound to the operator's limits and the shared engine cache."""

    def __init__(self, limits: Limits, cache: EngineCache | None = None):
        self.limits = limits
        self.cache = cache or EngineCache(limits)
        # The GPU work of /race and /generate, booked per call on ZeroGPU (the plain methods elsewhere).
        self.race_on_gpu = zerogpu.gpu(self.race, limits.gpu_duration_s)
        self.generate_on_gpu = zerogpu.gpu(self.generate_sync, limits.gpu_duration_s)
        # per model: (the engine's tuning, the This machine panel built from it), so it is built once per measurement
        self._views: dict[str, tuple[object, MachineView]] = {}

    def preload(self) -> None:
        """Load the first model before the first visitor: settle auto's plan (the kept tuning, else one
        measured behind the page: `EngineCache._settle`), warm it up and build the This machine panel. Not on
        ZeroGPU, where no CUDA work may run outside a GPU call: there the model is only loaded. On a failure
        the server starts anyway: the page shows why, and a later request tries again."""
        try:
            engine = self.cache.get(self.limits.models[0], warm_up=not zerogpu.on_zero_gpu())
        except ModelLoadError:
            return  # the cache has logged why and keeps the reason for the page
        self.machine(engine)

    def machine(self, engine: Engine) -> MachineView:
        """The This machine panel of `engine`, built once per measurement."""
        built = self._views.get(engine.name)
        if built is None or built[0] is not engine.tuning or engine.measuring is not None:
            built = self._views[engine.name] = (engine.tuning, machine_view(engine))
        return built[1]

    @visitor_errors
    def pass_split(self, model: str) -> tuple:
        """This machine's split of a pass, measured now (a few seconds, on the compute thread between visitors'
        decodes): where the time of each of SDSAT's passes at auto's k, and of the fastest vanilla's one-token
        pass, goes. Outputs: (split_html, split_plot)."""
        if zerogpu.on_zero_gpu():  # CUDA work may run only inside a GPU call there
            return (lines_html(["Not measured on ZeroGPU: the GPU is lent per request."]),
                    figures.empty_figure("Not measured"))
        engine = self._engine(model)
        if engine.measuring is not None:
            return (lines_html(["This machine is being measured behind the page; split a pass once that ends."]),
                    figures.empty_figure("Measuring this machine…"))
        k = max(1, auto_settings(engine.tuning, True, engine.max_k)["k"])
        splits = compute_thread().run(pass_time.split_here, engine, k, urgent=True)
        return pass_time.split_html(splits), figures.split_figure(splits, pass_time.CONTEXT)

    def auto_values(self, model: str, mode: str) -> dict:
        """auto's k, lookup_tokens and tree_candidates for `model` as loaded now (its plan for greedy or
        sampling; the fallback before it loads). Never loads a model."""
        engine = self.cache.get(model) if self.cache.is_loaded(model) else None
        if engine is None:
            return auto_settings(None)
        return auto_settings(engine.tuning, mode != "sampling", engine.max_k)

    # -- settings ------------------------------------------------------------------------------
    def _engine(self, model: str):
        try:
            return self.cache.get(model)
        except SettingError as err:
            raise invalid(err) from err
        except ModelLoadError as err:
            # The reason says what to do (install a package, reach the Hub, fix a folder); server paths in it
            # go to the log only.
            log.error("model %r could not be loaded: %s", model, err)
            raise gr.Error(f"The model {model!r} could not be loaded: {without_paths(str(err))}. The next request "
                           "tries again.", title="Model unavailable", print_exception=False) from None

    @visitor_errors
    def model_controls(self, model: str, mode: str = "greedy") -> tuple:
        """The controls that depend on `model`, in MODEL_OUTPUTS order, loading it if needed.

        The scheme goes to auto and the sliders to auto's plan for this machine (k within 1..the model's
        number of SATs); the line under the scheme says what auto chose and why. The chat checkbox and
        examples show only where the model has a chat template it is meant for.
        """
        engine = self._engine(model)
        chat = engine.chat_available
        chosen = auto_settings(engine.tuning, mode != "sampling", engine.max_k)
        view = self.machine(engine)
        return (gr.update(minimum=1, maximum=engine.max_k, step=1, value=chosen["k"]),
                gr.update(value=chosen["lookup_tokens"]), gr.update(value=chosen["tree_candidates"]),
                gr.update(value=DEFAULT_SCHEME),
                auto_note_html(auto_line(engine.tuning, chosen, mode != "sampling", engine.measuring)),
                gr.update(visible=chat, value=False), gr.update(visible=chat), view.html, view.figure)

    @visitor_errors
    def model_controls_if_loaded(self, model: str, mode: str = "greedy") -> tuple:
        """On page load: the controls of an already loaded model (MODEL_OUTPUTS, then the headline), without
        waiting behind running races (or loads); a model whose last load failed says why in the headline."""
        if self.cache.is_loaded(model):
            return (*self.model_controls(model, mode), gr.skip())
        failure = self.cache.failure(model)
        note = (gr.update(value=f'<div class="check bad">The model could not be loaded: {esc(without_paths(failure))}. '
                                'The next race tries again.</div>') if failure else gr.skip())
        return (*[gr.skip()] * len(MODEL_OUTPUTS), note)

    @visitor_errors
    def plan_watch(self, model: str, mode: str = "greedy", scheme: str = DEFAULT_SCHEME,
                   watched: bool = False) -> tuple:
        """The page's timer, while this machine is measured behind it: the auto note and the This machine panel
        as they stand, then, once the plan is ready, auto's sliders (when auto is picked and this page saw the
        measurement: `watched`, else the page loaded with the plan and its sliders may be the visitor's own by
        now) and the timer stopped. Outputs: (auto_note, machine, machine_plot, k, lookup_tokens,
        tree_candidates, timer, watched). Never loads a model nor waits for one."""
        skip = gr.skip()
        if not self.cache.is_loaded(model):
            return (skip,) * 6 + (gr.Timer(active=self.cache.failure(model) is None), True)  # it loads meanwhile
        engine = self.cache.get(model)
        measuring = engine.measuring  # read once: the tuning thread clears it right after the swap below
        if measuring is None and self.cache.get(model) is not engine:  # the tuned engine replaced this one
            engine = self.cache.get(model)
            measuring = engine.measuring
        chosen = auto_settings(engine.tuning, mode != "sampling", engine.max_k)
        note = auto_note_html(auto_line(engine.tuning, chosen, mode != "sampling", measuring))
        view = self.machine(engine)
        if measuring is not None:
            return note, view.html, skip, skip, skip, skip, gr.Timer(active=True), True
        sliders = ((chosen["k"], chosen["lookup_tokens"], chosen["tree_candidates"])
                   if watched and SCHEME_LABELS.get(scheme) == AUTO else (skip,) * 3)
        return note, view.html, view.figure, *sliders, gr.Timer(active=False), watched

    @visitor_errors
    def scheme_controls(self, scheme: str, model: str, mode: str) -> tuple:
        """The sliders (k, lookup, tree) for a scheme picked on the radio: auto's plan for the loaded model and
        this mode, a fixed scheme's values, or as they are for custom."""
        if scheme == CUSTOM:
            return gr.skip(), gr.skip(), gr.skip()
        values = _checked(scheme_settings, scheme, self.auto_values(model, mode))
        return values["k"], values["lookup_tokens"], values["tree_candidates"]

    @visitor_errors
    def scheme_label(self, k, lookup_tokens, tree_candidates, model: str, mode: str) -> str:
        """The radio's label for slider values a visitor set (CUSTOM when no scheme has them)."""
        return scheme_of(k, lookup_tokens, tree_candidates, self.auto_values(model, mode))

    @visitor_errors
    def mode_controls(self, mode: str, scheme: str, model: str) -> tuple:
        """(sampling settings, k, lookup, tree) for a decoding mode: sampling shows its settings; under auto the
        sliders follow auto's plan for that mode."""
        sampling = mode == "sampling"
        values = self.auto_values(model, mode) if SCHEME_LABELS.get(scheme) == AUTO else {}
        return (gr.update(visible=sampling), values.get("k", gr.skip()), values.get("lookup_tokens", gr.skip()),
                values.get("tree_candidates", gr.skip()))

    def prepare(self, inputs: Mapping) -> tuple:
        """Parse the request, load the model, check the settings once, encode the prompt:
        (engine, request, prompt_ids)."""
        try:
            request = parse_request(self.limits, inputs)
            engine = self._engine(request.model)
            request.validate(self.limits, engine.max_k)
            if request.chat and not getattr(engine.tokenizer, "chat_template", None):
                raise SettingError(f"chat must be false for {request.model}: this model has no chat template")
            prompt_ids = engine.encode(request.prompt, chat=request.chat)
            check_prompt_ids(self.limits, prompt_ids, request, max_context(engine))
        except SettingError as err:  # only our own messages: a ValueError from deeper down may name server paths
            raise invalid(err) from None
        return engine, request, prompt_ids

    # -- the race ------------------------------------------------------------------------------
    @visitor_errors
    def race(self, prompt, model, chat, mode, k, max_new_tokens, temperature, top_p, top_k, seed,
             show_rejected=False, lookup_tokens=0, tree_candidates=0) -> Iterator[tuple]:
        """/race: race vanilla against SDSAT and stream the page; yields tuples in RACE_OUTPUTS order.

        The parameters are /race's inputs, in RACE_INPUTS order (Gradio passes the components so).
        """
        inputs = request_inputs(locals())
        skip = gr.skip()
        show_rejected = _checked(check_flag, "show rejected drafts", show_rejected)
        if not self.cache.is_loaded(model) and model in self.limits.models:
            yield (progress_html(None, f"Loading {model} and measuring this machine's pass costs… (first start of "
                                       "a model; later runs begin at once)"),
                   *[skip] * (len(RACE_OUTPUTS) - 1))
        engine, request, prompt_ids = self.prepare(inputs)
        measuring = _measuring_line(engine)
        special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
        cancel = threading.Event()
        snaps = race(engine, prompt_ids, request, self.limits.time_limit_s, cancel)
        cleared = None  # the outputs a race in progress leaves empty (RACE_OUTPUTS[3:])
        try:
            for snap in snaps:
                if snap.phase != "done":
                    sdsat_pane = (waiting_html("Waiting: SDSAT starts when vanilla has finished.")
                                  if snap.phase == "vanilla" else
                                  sdsat_html(snap.steps["sdsat"], snap.pieces["sdsat"], special_ids=special))
                    yield (progress_html(snap), vanilla_html(snap.steps["vanilla"], snap.pieces["vanilla"], special),
                           sdsat_pane, *(cleared or racing_outputs(first=True)))
                    cleared = racing_outputs(first=False)
                    continue
                record = make_record(engine, request, prompt_ids, snap, measuring)
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

    @visitor_errors
    def sdsat_pane(self, record: RaceRecord | None, show_rejected: bool):
        show_rejected = _checked(check_flag, "show rejected drafts", show_rejected)
        if record is None:  # a race runs (or ran and was stopped, or its record expired): its pane stays as it is
            return gr.skip()
        return sdsat_html(record.sdsat.steps, record.pieces["sdsat"], record.vocab, show_rejected,
                          record.special_ids)

    # -- after a race: the explorer -----------------------------------------------------
    @staticmethod
    @visitor_errors
    def explore(record: RaceRecord | None, iteration) -> str:
        """The explorer at `iteration` (1-based, as the slider shows it)."""
        return explorer.explorer_html(record, min(_checked(check_iteration, iteration), _iterations(record)) - 1)

    @staticmethod
    @visitor_errors
    def step(record: RaceRecord | None, iteration, delta: int) -> tuple:
        """Move the explorer by `delta` iterations: (slider value, explorer HTML); nothing moves without a record
        (a race runs, or ran and was stopped, or its record expired)."""
        n = _iterations(record)
        i = max(1, min(_checked(check_iteration, iteration) + delta, n))
        if record is None:
            return gr.skip(), gr.skip()
        return i, explorer.explorer_html(record, i - 1)

    # -- API -------------------------------------------------------------------------------------
    @visitor_errors
    async def generate(self, prompt: str, model: str = "", chat: bool = False, mode: str = "greedy",
                       k: int = DecodeConfig.k, max_new_tokens: int = 64, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = 0,
                       seed: int = 0, lookup_tokens: int = 0, tree_candidates: int = 0) -> dict:
        """Race vanilla and SDSAT on one prompt; return both texts, token ids and metrics as JSON.

        `model` is one of the operator's models (empty: the first). `lookup_tokens` > 0 lets SDSAT verify
        up to that many prompt-lookup copies where the text recurs; `tree_candidates` > 0 lets SDSAT also
        verify that many of the SATs' runner-up candidates, or under sampling further draws (a draft tree,
        verified losslessly by multi-draft rejection sampling). Greedy runs report whether the two
        outputs were identical; every decoder stops at the operator's limits.
        """
        inputs = request_inputs(locals())  # the parameters above, spelled out for Gradio's API schema
        cancel = threading.Event()
        try:
            # A cancelled call stops waiting at once and sets `cancel`, so the decoder stops at its next
            # iteration instead of running on for nobody.
            return await anyio.to_thread.run_sync(self.generate_on_gpu, inputs, *zerogpu.cancel_args(cancel),
                                                  abandon_on_cancel=True)
        finally:
            cancel.set()

    def generate_sync(self, inputs: Mapping, cancel: threading.Event | None = None) -> dict:
        """`generate` in the calling thread, its inputs by name (REQUEST_INPUTS); setting `cancel` stops it
        between two iterations."""
        engine, request, prompt_ids = self.prepare({**inputs, "model": inputs["model"] or self.limits.models[0]})
        measuring = _measuring_line(engine)
        cancel = cancel or threading.Event()
        snap = None
        snaps = race(engine, prompt_ids, request, self.limits.time_limit_s, cancel)
        try:
            for snap in snaps:
                pass
        finally:
            cancel.set()
            snaps.close()
        if snap is None or snap.phase != "done":  # cancelled: the race stopped before its SDSAT phase
            raise gr.Error("The request was cancelled before both decoders ran.", title="Cancelled")
        return make_record(engine, request, prompt_ids, snap, measuring).to_dict()


def racing_outputs(first: bool) -> tuple:
    """RACE_OUTPUTS[3:] while a race runs: the last race's plots, explorer, record and data are cleared.

    Plain values, not gr.skip(): Gradio builds a new component and its whole config for every skipped output
    of every snapshot, on the thread that serves the page, and that work takes the CPU from the decoder. The
    slider becomes inactive once, in the first snapshot; later ones only repeat its value, which sends nothing.
    """
    slider = gr.Slider(value=1, interactive=False) if first else 1
    return (None, None, None, None, slider, explorer.RACING, None, None)


def auto_note_html(line: str) -> str:
    """The line under the scheme radio: what auto chose on this machine, or why it keeps its defaults."""
    return f'<div class="auto-note muted">{esc(line)}</div>'


def _measuring_line(engine: Engine) -> str | None:
    """Where the machine's measurement stands, for a race beginning now; None when none runs."""
    measuring = engine.measuring  # read once: the tuning thread may clear it at any moment
    return measuring.line() if measuring is not None else None


def _iterations(record: RaceRecord | None) -> int:
    return len(record.sdsat.steps) if record is not None else 1


def _checked(check, *args):
    """`check(*args)`, its SettingError shown to the visitor as an invalid setting."""
    try:
        return check(*args)
    except SettingError as err:
        raise invalid(err) from None


__all__ = ["MODEL_OUTPUTS", "Page", "RACE_INPUTS", "RACE_OUTPUTS"]
