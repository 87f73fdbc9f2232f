"""The race: vanilla decoding, then SDSAT, on the same prompt, streamed as snapshots.

The two decoders run one after the other, never at once: on a 2-core machine they would compete
for the CPU and both timings would be wrong. Each decoder runs on the process's compute thread
(compute.py), which only decodes, so the page's rendering between updates never lands inside the
decoder's clock, and decodes run at the engine's full speed; the caller gets a `RaceSnapshot` at most
every `every` seconds. Closing the generator (Gradio does this on Stop or when the visitor leaves)
cancels the decoder between two iterations.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from .. import hardware
from ..compute import compute_thread
from ..decoding import GenerationResult, StepRecord
from ..engine import Engine
from .machine import NO_COSTS, RaceCosts, race_costs
from .render import PieceDecoder, pieces_of
from .settings import RunRequest

PHASES = ("vanilla", "sdsat")


@dataclass
class RaceSnapshot:
    """What has happened so far; `phase` is the decoder running now, or "done"."""

    phase: str
    steps: dict[str, list[StepRecord]]  # per method, the iterations so far
    pieces: dict[str, list[str]]  # per method, the text of each emitted token
    results: dict[str, GenerationResult] = field(default_factory=dict)  # per finished method


@dataclass
class RaceRecord:
    """A finished race: everything the page shows about it, kept per visitor in gr.State."""

    model: str
    sat_trained: bool
    settings: dict
    prompt_ids: list[int]
    vanilla: GenerationResult
    sdsat: GenerationResult
    pieces: dict[str, list[str]]  # per method, the text of each emitted token
    vocab: dict[int, str]  # text of single token ids (drafts, predictions, context) for the explorer
    special_ids: set[int]
    hardware: str
    time_limited: bool  # a decoder hit the per-request wall-time limit
    costs: RaceCosts | None = None  # predicted and implied speed-ups (machine.py); None where nothing was measured
    measuring: str | None = None  # where the machine's measurement stood when the race began (auto's fallback then)

    @property
    def greedy(self) -> bool:
        return self.settings.get("mode") == "greedy"

    def identical(self) -> tuple[bool, int]:
        """(equal token ids over the compared length, compared length). When one decoder was stopped
        early (time limit or Stop), the shorter output is compared with the start of the other."""
        a, b = self.vanilla.token_ids, self.sdsat.token_ids
        n = min(len(a), len(b))
        same = a[:n] == b[:n] and (len(a) == len(b) or self.vanilla.stop_reason == "cancelled"
                                   or self.sdsat.stop_reason == "cancelled")
        return same, n

    @property
    def speedup(self) -> float:
        return self.sdsat.tokens_per_second / self.vanilla.tokens_per_second

    def to_dict(self) -> dict:
        """Plain data for the API: texts, token ids and the metrics of both decoders."""
        same, compared = self.identical()
        return {
            "model": self.model, "sat_trained": self.sat_trained, "settings": self.settings,
            "hardware": self.hardware, "sequential": True, "time_limited": self.time_limited,
            "vanilla": self.vanilla.summary() | {"text": self.vanilla.text, "token_ids": self.vanilla.token_ids},
            "sdsat": self.sdsat.summary() | {"text": self.sdsat.text, "token_ids": self.sdsat.token_ids},
            "speedup": self.speedup,
            "identical": (same if self.greedy else None), "compared_tokens": compared,
            "measuring": self.measuring,
        } | (self.costs.to_dict() if self.costs is not None else NO_COSTS)


def hardware_line(engine: Engine) -> str:
    return hardware.hardware_line(engine.model)


def race(engine: Engine, prompt_ids: list[int], request: RunRequest, time_limit_s: float,
         cancel: threading.Event | None = None, every: float = 0.3,
         methods: tuple[str, ...] = PHASES) -> Iterator[RaceSnapshot]:
    """Run vanilla, then SDSAT; yield snapshots, the last one with phase "done" and both results.

    `methods` runs a subset, on the same compute thread (the Chat tab decodes a turn with SDSAT alone,
    and vanilla alone when the visitor races that turn).

    Each decoder may use `time_limit_s / 2` seconds of wall time; it then stops between two
    iterations with stop_reason "cancelled", as it does when `cancel` is set or the generator is closed.
    Once `cancel` is set no further decoder starts, and the generator ends without a "done" snapshot.
    """
    cancel = cancel or threading.Event()
    snap = RaceSnapshot("vanilla", {m: [] for m in PHASES}, {m: [] for m in PHASES})
    for method in methods:
        if cancel.is_set():  # Stop, or an API call given up: nobody is waiting for the next decoder
            return
        snap.phase = method
        inbox = _Inbox()
        decoder = PieceDecoder(engine.tokenizer, prompt_ids)
        compute_thread().submit(_drain, engine, prompt_ids, request.decode_config(method), cancel, time_limit_s / 2,
                                inbox, urgent=True)
        try:
            while True:
                ended = inbox.ended.wait(every)
                for event in inbox.take():
                    if isinstance(event, BaseException):
                        raise event
                    if isinstance(event, StepRecord):
                        snap.steps[method].append(event)
                        snap.pieces[method].extend(decoder.add(t) for t in event.tokens)
                    elif isinstance(event, GenerationResult):
                        if snap.pieces[method]:
                            snap.pieces[method][-1] += decoder.flush()
                        snap.results[method] = event
                if ended:
                    break
                yield snap
        finally:
            # Stop, disconnect or an error: the decoder stops at its next iteration boundary. Gradio closes
            # this generator on its event loop, so it is not waited for here (that would stall every visitor
            # for up to a forward pass); the next decode queues behind it on the compute thread, so no
            # request shares the CPU with an abandoned one.
            if method not in snap.results:
                cancel.set()
        if method not in snap.results:
            if cancel.is_set():  # given up while it waited for the compute thread
                return
            raise RuntimeError(f"the {method} decoder ended without a result")
    snap.phase = "done"
    yield snap


class _Inbox:
    """A decode's events, handed from the compute thread to the page's thread in batches: the page's thread
    wakes every `every` seconds or when the decode ends, not at every forward pass (each wake-up would take
    the GIL and a core from the decoder's threads in the middle of a pass)."""

    def __init__(self) -> None:
        self._events: list = []
        self._lock = threading.Lock()
        self.ended = threading.Event()  # set after the decode's last event

    def put(self, event) -> None:
        with self._lock:
            self._events.append(event)

    def take(self) -> list:
        """The events put since the last take, in order."""
        with self._lock:
            events, self._events = self._events, []
        return events


def _drain(engine: Engine, prompt_ids, config, cancel: threading.Event, limit_s: float, inbox: _Inbox) -> None:
    """Decode on the compute thread, handing each event over; the time limit counts from the decode's start, not
    from the time it waited in the queue."""
    deadline, compute = time.monotonic() + limit_s, compute_thread()
    try:
        if cancel.is_set():  # given up while it waited
            return
        stop = lambda: cancel.is_set() or compute.stopping or time.monotonic() > deadline  # noqa: E731
        for event in engine.stream(prompt_ids, config, stop):
            inbox.put(event)
    except Exception as err:  # handed to the page's thread, which raises it
        inbox.put(err)
    finally:
        inbox.ended.set()


def make_record(engine: Engine, request: RunRequest, prompt_ids: list[int], snap: RaceSnapshot,
                measuring: str | None = None) -> RaceRecord:
    """Freeze a finished race into what the page keeps: results, token texts, explorer vocabulary; `measuring`
    is the tuning's progress line when the race began behind one."""
    vanilla, sdsat = snap.results["vanilla"], snap.results["sdsat"]
    ids = set(prompt_ids[-12:]) | set(sdsat.token_ids)
    for step in sdsat.steps:
        ids.update(step.drafts)
        ids.update(step.predictions)
        ids.update(step.tree_tokens)  # the draft tree's candidates, drawn in the explorer
    vocab = dict(zip(sorted(ids), pieces_of_each(engine, sorted(ids))))
    special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
    record = RaceRecord(
        model=engine.name, sat_trained=engine.sat_trained, settings=request.settings(), prompt_ids=list(prompt_ids),
        vanilla=vanilla, sdsat=sdsat, pieces={m: list(snap.pieces[m]) for m in PHASES}, vocab=vocab,
        special_ids=special, hardware=hardware_line(engine),
        time_limited=any(r.stop_reason == "cancelled" for r in (vanilla, sdsat)), measuring=measuring)
    record.costs = race_costs(engine, request.config, sdsat, record.speedup, chat=request.chat)
    return record


def pieces_of_each(engine: Engine, ids: list[int]) -> list[str]:
    """Text of each id decoded on its own (for chips in the step explorer)."""
    return [pieces_of(engine.tokenizer, [i])[0] for i in ids]
