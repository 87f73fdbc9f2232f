"""The Chat tab: a conversation whose every assistant turn is decoded by SDSAT, coloured like the race.

Each turn is the conversation so far in the model's chat template. When it no longer fits the
prompt limit (the operator's, and the model's context less the new tokens), the oldest messages are
left out and the turn says how many. A turn's vanilla check runs only on request ("Race this turn"):
a reply then arrives as fast as SDSAT gives it, and the next turn never queues behind a check that
nobody asked for. The same operator limits, engine cache and queue as the race apply.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import anyio.to_thread
import gradio as gr

from ..decoding import GenerationResult, StepRecord
from ..models import ModelLoadError
from ..prompts import check_unicode, encode_chat
from . import zerogpu
from .handlers import visitor_errors, without_paths
from .presets import AUTO, FALLBACK, SCHEME_LABELS, auto_settings, scheme_settings
from .race import race
from .registry import EngineCache, max_context
from .render import esc, sdsat_html
from .settings import (Limits, RunRequest, SettingError, check_flag, check_prompt_ids, parse_request,
                       request_inputs)

ROLES = ("system", "user", "assistant")
HISTORY_CHARS = 4  # the API's history is cut to this many times the prompt's character limit before tokenizing
CHAT_TOP_P, CHAT_TOP_K = 0.95, 50  # the Chat tab's sampling, beside its temperature


@dataclass
class ChatTurn:
    """One exchange: the visitor's message and SDSAT's reply, with the records the page draws."""

    user: str
    request: RunRequest  # the checked settings this turn was decoded with
    prompt_ids: list[int]  # the conversation up to this turn, in the chat template
    left_out: int = 0  # earlier messages left out so that the conversation fits the prompt limit
    special_ids: set[int] = field(default_factory=set)
    steps: list[StepRecord] = field(default_factory=list)  # SDSAT's iterations so far
    pieces: list[str] = field(default_factory=list)  # text of each emitted token
    result: GenerationResult | None = None  # set once SDSAT finished
    stopped: bool = False  # the visitor pressed Stop while it decoded
    vanilla: GenerationResult | None = None  # set once the visitor raced this turn
    racing: bool = False  # the vanilla decode of this turn is running
    runs: int = 1  # 1, plus one per Regenerate
    fallback: bool = False  # auto stood for its fallback settings: this machine was being measured

    @property
    def token_ids(self) -> list[int]:
        return [t for step in self.steps for t in step.tokens]

    @property
    def reply(self) -> str:
        """The reply as the next turn's history sees it: special tokens such as <|im_end|> left out."""
        if self.result is not None:
            return self.result.text
        return "".join(p for p, t in zip(self.pieces, self.token_ids) if t not in self.special_ids)

    def identical(self) -> bool | None:
        """Greedy: SDSAT's tokens equal the vanilla decode's; None until raced, or when sampling."""
        if self.vanilla is None or self.result is None or self.request.mode != "greedy":
            return None
        return self.vanilla.token_ids == self.result.token_ids

    def summary(self) -> dict:
        same = self.identical()
        return {"reply": self.reply, "token_ids": self.token_ids, "left_out_messages": self.left_out,
                "notice": left_out_notice(self.left_out, self.request, len(self.prompt_ids)) or None,
                "settings": self.request.settings(), "prompt_tokens": len(self.prompt_ids),
                "sdsat": self.result.summary() if self.result else None,
                "vanilla": self.vanilla.summary() if self.vanilla else None, "identical": same,
                "speedup": (self.result.tokens_per_second / self.vanilla.tokens_per_second
                            if self.result and self.vanilla else None)}


def history_of(turns: list[ChatTurn]) -> list[dict]:
    """The conversation as chat-template messages (the replies as decoded, special tokens left out)."""
    messages = []
    for turn in turns:
        messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.reply}]
    return messages


def check_message(message) -> str:
    """The visitor's new message: non-empty text; raises SettingError naming it."""
    if not isinstance(message, str) or not message.strip():
        raise SettingError("message is empty: type something to say to the model")
    try:
        return check_unicode("message", message)
    except ValueError as err:
        raise SettingError(str(err)) from None


def check_history(history) -> list[dict]:
    """An API caller's history as messages; raises SettingError naming the first bad message."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise SettingError(f"history must be a list of {{role, content}} messages, got {type(history).__name__}")
    messages = []
    for i, message in enumerate(history, start=1):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise SettingError(f"history message {i} must be {{\"role\": one of {', '.join(ROLES)}, "
                               f"\"content\": text}}, got {str(message)[:80]!r}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def fit_conversation(tokenizer, history: list[dict], user: str, budget: int) -> tuple[list[int], int]:
    """The chat-template ids of `history` + the new user message, leaving out the oldest messages until
    they fit `budget` tokens: (ids, messages left out). A leading system message is always kept; what is
    kept starts with a user message. The new message alone may still be too long (the caller checks)."""
    system = history[:1] if history and history[0]["role"] == "system" else []
    rest = history[len(system):] + [{"role": "user", "content": user}]
    drop = 0
    while True:
        ids = encode_chat(tokenizer, system + rest[drop:])
        if len(ids) <= budget or drop == len(rest) - 1:
            return ids, drop
        drop += 1
        while drop < len(rest) - 1 and rest[drop]["role"] != "user":
            drop += 1


def left_out_notice(left_out: int, request: RunRequest, prompt_tokens: int) -> str:
    if not left_out:
        return ""
    return (f"{left_out} earlier message{'s' if left_out != 1 else ''} left out: the conversation must fit the "
            f"prompt limit with room for {request.config.max_new_tokens} new tokens "
            f"(this turn's prompt: {prompt_tokens} tokens).")


# -- the page's view of a conversation ------------------------------------------------------------
def scheme_name(settings: dict) -> str:
    parts = [f"k={settings['k']}"]
    if settings.get("lookup_tokens"):
        parts.append("+lookup")
    if settings.get("tree_candidates"):
        parts.append("+tree")
    return " ".join(parts)


def badge_html(turn: ChatTurn) -> str:
    """The small line under a reply: speed, tokens per pass, and the vanilla check."""
    n = len(turn.token_ids)
    items = []
    if turn.result is None:
        items.append(f'<span class="badge warn">stopped after {n} tokens</span>' if turn.stopped
                     else f'<span class="badge run">SDSAT decoding… {n} tokens</span>')
    else:
        r = turn.result
        items.append(f'<span class="badge speed" title="new tokens ÷ wall time, prompt reading included">'
                     f'{r.tokens_per_second:.1f} tokens/s</span>')
        items.append(f'<span class="badge" title="new tokens ÷ forward passes of the model (vanilla: 1.00)">'
                     f'{r.tokens_per_forward_pass:.2f} tokens/pass</span>')
        same = turn.identical()
        if turn.racing:
            items.append('<span class="badge run">racing vanilla on this turn…</span>')
        elif same is True:
            speed = r.tokens_per_second / turn.vanilla.tokens_per_second
            items.append(f'<span class="badge ok" title="vanilla greedy decoding of the same prompt gave the same '
                         f'{n} token ids">✓ identical to vanilla · {speed:.2f}× its '
                         f'{turn.vanilla.tokens_per_second:.1f} tokens/s</span>')
        elif same is False:
            first = next((i for i, (a, b) in enumerate(zip(turn.vanilla.token_ids, r.token_ids)) if a != b),
                         min(len(turn.vanilla.token_ids), n))
            items.append(f'<span class="badge bad">✗ differs from vanilla at token {first + 1}</span>')
        elif turn.request.mode == "greedy":
            items.append('<span class="badge" title="Press Race this turn: vanilla decodes the same prompt and '
                         'the token ids are compared">identical check: not run yet</span>')
        else:
            items.append('<span class="badge" title="sampling draws a different text each time; speculative '
                         'sampling keeps the distribution">sampling: no identical check</span>')
    items.append(f'<span class="muted">{esc(scheme_name(turn.request.settings()))}'
                 f'{" · regenerated" if turn.runs > 1 else ""}</span>')
    if turn.fallback:
        items.append('<span class="badge fallback" title="auto\'s plan is not ready until this machine has been '
                     'measured, behind the page">auto: fallback settings while this machine is measured</span>')
    notice = left_out_notice(turn.left_out, turn.request, len(turn.prompt_ids))
    if notice:
        items.append(f'<span class="badge warn trimmed">{esc(notice)}</span>')
    return f'<div class="turn-badge">{"".join(items)}</div>'


def turn_html(turn: ChatTurn, index: int) -> str:
    """A reply coloured by token source, with its badge: one HTML block for the Chatbot's markdown.

    Newlines become `&#10;`: a blank line would end the HTML block and hand the rest to markdown. The
    Chatbot's sanitizer drops data-* attributes, so the turn's number and run are classes."""
    body = sdsat_html(turn.steps, turn.pieces, special_ids=turn.special_ids)
    return f'<div class="chat-turn turn-{index} run-{turn.runs}">{body}{badge_html(turn)}</div>'.replace("\n", "&#10;")


def user_html(text: str) -> str:
    return f'<div class="chat-user">{esc(text)}</div>'.replace("\n", "&#10;")


def messages_of(turns: list[ChatTurn]) -> list[dict]:
    """The gr.Chatbot value for `turns`."""
    messages = []
    for i, turn in enumerate(turns):
        messages += [{"role": "user", "content": user_html(turn.user)},
                     {"role": "assistant", "content": turn_html(turn, i)}]
    return messages


class Chat:
    """The Chat tab's handlers, bound to the operator's limits and the engine cache the race uses."""

    def __init__(self, limits: Limits, cache: EngineCache):
        self.limits = limits
        self.cache = cache
        # The GPU work of the tab and of /chat, booked per call on ZeroGPU (zerogpu.py); the plain methods elsewhere.
        duration = limits.gpu_duration_s
        self.respond_on_gpu = zerogpu.gpu(self.respond, duration)
        self.regenerate_on_gpu = zerogpu.gpu(self.regenerate, duration)
        self.race_turn_on_gpu = zerogpu.gpu(self.race_turn, duration)
        self.turn_on_gpu = zerogpu.gpu(self.turn_sync, duration)

    def _engine(self, model: str):
        try:
            return self.cache.get(model)
        except ModelLoadError as err:
            raise SettingError(f"the model {model!r} could not be loaded: {without_paths(str(err))}. The next "
                               "request tries again") from err

    def start_turn(self, inputs: Mapping, history: list[dict]) -> ChatTurn:
        """Check the settings (REQUEST_INPUTS by name, the message as the prompt) and fit the conversation:
        a turn ready to decode. Raises SettingError."""
        request = parse_request(self.limits, inputs)
        engine = self._engine(request.model)
        request.validate(self.limits, engine.max_k)
        context = max_context(engine)
        budget = self.limits.max_prompt_tokens
        if context is not None:  # the decoder's own rule: room for the new tokens and the draft positions
            budget = min(budget, request.config.prompt_room(context))
        kept = _cut_by_chars(history, HISTORY_CHARS * self.limits.max_prompt_chars)
        try:
            prompt_ids, dropped = fit_conversation(engine.tokenizer, kept, request.prompt, budget)
        except ValueError as err:  # no chat template, or text that is not valid Unicode
            raise SettingError(str(err)) from err
        check_prompt_ids(self.limits, prompt_ids, request, context)
        left_out = len(history) - len(kept) + dropped
        return ChatTurn(user=request.prompt, request=request, prompt_ids=prompt_ids, left_out=left_out,
                        special_ids=set(getattr(engine.tokenizer, "all_special_ids", []) or []))

    def decode(self, turn: ChatTurn, cancel: threading.Event) -> Iterator[ChatTurn]:
        """SDSAT decodes `turn`; yields it as its records grow, the last time with `result` set."""
        engine = self._engine(turn.request.model)
        snaps = race(engine, turn.prompt_ids, turn.request, self.limits.time_limit_s, cancel, methods=("sdsat",))
        try:
            for snap in snaps:
                turn.steps, turn.pieces = list(snap.steps["sdsat"]), list(snap.pieces["sdsat"])
                turn.result = snap.results.get("sdsat")
                yield turn
        finally:
            snaps.close()  # a closed race stops its decoder at the next iteration

    def check(self, turn: ChatTurn, cancel: threading.Event) -> ChatTurn:
        """Vanilla decodes the turn's prompt with the same settings; `turn.vanilla` is set."""
        engine = self._engine(turn.request.model)
        snaps = race(engine, turn.prompt_ids, turn.request, self.limits.time_limit_s, cancel, methods=("vanilla",))
        try:
            for snap in snaps:
                turn.vanilla = snap.results.get("vanilla", turn.vanilla)
        finally:
            snaps.close()
        return turn

    # -- the page's events ---------------------------------------------------------------------
    @visitor_errors
    def respond(self, message: str, turns: list[ChatTurn] | None, model: str, scheme: str, mode: str,
                temperature: float, max_new_tokens: int) -> Iterator[tuple]:
        """Send: (chatbot, turns, message box) as the reply grows."""
        turns = list(turns or [])
        yield from self._reply(message, turns, model, scheme, mode, temperature, max_new_tokens, runs=1, clear_box=True)

    @visitor_errors
    def regenerate(self, turns: list[ChatTurn] | None, model: str, scheme: str, mode: str, temperature: float,
                   max_new_tokens: int) -> Iterator[tuple]:
        """Decode the last turn again (a new seed when sampling); the turns before it stay as they are."""
        turns = list(turns or [])
        if not turns:
            raise gr.Error("Nothing to regenerate: send a message first.", title="Chat")
        last = turns.pop()
        yield from self._reply(last.user, turns, model, scheme, mode, temperature, max_new_tokens, runs=last.runs + 1,
                               clear_box=False)

    def _reply(self, message, turns, model, scheme, mode, temperature, max_new_tokens, runs, clear_box):
        box = "" if clear_box else gr.skip()
        try:
            engine = self._engine(model)  # auto's values are the loaded model's plan for this machine
            planned_t = temperature if isinstance(temperature, (int, float)) else 1.0  # checked with the rest below
            auto = auto_settings(engine.tuning, mode != "sampling", engine.max_k, planned_t, CHAT_TOP_P, CHAT_TOP_K,
                                 chat=True)
            inputs = dict(prompt=check_message(message), model=model, chat=True, mode=mode,
                          max_new_tokens=max_new_tokens, temperature=temperature, top_p=CHAT_TOP_P, top_k=CHAT_TOP_K,
                          seed=runs - 1) | scheme_settings(scheme, auto)
            turn = self.start_turn(inputs, history_of(turns))
            turn.fallback = engine.measuring is not None and engine.tuning is None and SCHEME_LABELS.get(scheme) == AUTO
        except SettingError as err:
            raise gr.Error(str(err), title="Invalid setting", print_exception=False) from err
        turn.runs = runs
        turns.append(turn)
        yield messages_of(turns), turns, box
        cancel = threading.Event()
        for turn in self.decode(turn, cancel):
            yield messages_of(turns), turns, gr.skip()

    @visitor_errors
    def race_turn(self, turns: list[ChatTurn] | None) -> Iterator[tuple]:
        """Race this turn: vanilla decodes the last turn's prompt; the badge shows whether the ids match."""
        turns = list(turns or [])
        if not turns or turns[-1].result is None:
            raise gr.Error("Nothing to race: wait for a finished reply.", title="Chat")
        turn = turns[-1]
        if turn.request.mode != "greedy":
            raise gr.Error("Race this turn checks greedy replies; sampling draws a different text by design.",
                           title="Chat")
        turn.racing = True
        yield messages_of(turns), turns
        try:
            self.check(turn, threading.Event())
        finally:
            turn.racing = False
        yield messages_of(turns), turns

    @staticmethod
    def stopped(turns: list[ChatTurn] | None) -> tuple:
        """After Stop: an unfinished last turn says it was stopped (its text so far stays)."""
        turns = list(turns or [])
        if turns and turns[-1].result is None:
            turns[-1].stopped = True
        if turns:
            turns[-1].racing = False
        return messages_of(turns), turns

    @staticmethod
    def clear() -> tuple:
        return [], []

    # -- API -----------------------------------------------------------------------------------
    @visitor_errors
    async def turn(self, message: str, history: list[dict] | None = None, model: str = "", mode: str = "greedy",
                   k: int = FALLBACK["k"], max_new_tokens: int = 64, temperature: float = 1.0,
                   top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                   lookup_tokens: int = FALLBACK["lookup_tokens"],
                   tree_candidates: int = FALLBACK["tree_candidates"], check_vanilla: bool = False) -> dict:
        """One chat turn: SDSAT replies to `message` after `history`; returns the reply and its metrics.

        `history` is the conversation before it, a list of {"role": "user" | "assistant" | "system",
        "content": text} messages; the oldest are left out when it does not fit the prompt limit
        (`left_out_messages` says how many). With `check_vanilla`, vanilla decodes the same prompt
        afterwards and `identical` says whether greedy SDSAT gave the same token ids.
        """
        # the parameters above, spelled out for Gradio's API schema; the message is the prompt
        inputs = request_inputs(locals()) | {"prompt": message, "chat": True}
        cancel = threading.Event()
        try:
            return await anyio.to_thread.run_sync(self.turn_on_gpu, inputs, history, check_vanilla,
                                                  *zerogpu.cancel_args(cancel), abandon_on_cancel=True)
        finally:
            cancel.set()

    def turn_sync(self, inputs: Mapping, history, check_vanilla=False, cancel: threading.Event | None = None) -> dict:
        """`turn` in the calling thread, its settings by name (REQUEST_INPUTS); setting `cancel` stops it."""
        cancel = cancel or threading.Event()
        try:
            check_message(inputs["prompt"])
            check_vanilla = check_flag("check_vanilla", check_vanilla)
            inputs = {**inputs, "model": inputs["model"] or self.limits.models[0]}
            turn = self.start_turn(inputs, check_history(history))
        except SettingError as err:
            raise gr.Error(str(err), title="Invalid setting", print_exception=False) from err
        for turn in self.decode(turn, cancel):
            pass
        if check_vanilla and turn.request.mode == "greedy" and turn.result is not None:
            self.check(turn, cancel)
        out = turn.summary()
        out["history"] = check_history(history) + [{"role": "user", "content": turn.user},
                                                   {"role": "assistant", "content": turn.reply}]
        return out


def _cut_by_chars(history: list[dict], limit: int) -> list[dict]:
    """The last messages whose text adds up to at most `limit` characters (before any tokenizing)."""
    kept, total = [], 0
    for message in reversed(history):
        total += len(message["content"])
        if total > limit:
            break
        kept.append(message)
    return kept[::-1]


__all__ = ["Chat", "ChatTurn", "check_history", "fit_conversation", "messages_of"]
