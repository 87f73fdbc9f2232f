"""Prompts in, stop decisions out: encoding raw or chat prompts, and deciding where output ends."""

from __future__ import annotations

import threading
from typing import Sequence

_MARK = "\ue000SDSAT_PROMPT\ue000"  # a private-use placeholder no template contains
_ENCODE_LOCK = threading.Lock()  # every encode that sets split_special_tokens goes through it (see tokens())


def check_unicode(name: str, text: str) -> str:
    """`text` if it can be encoded; a ValueError naming `name` for a lone surrogate (JSON's "\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} must be valid Unicode text; it has an unpaired surrogate at character "
                         f"{err.start}") from None
    return text


def encode_prompt(tokenizer, prompt: str, chat: bool = False, allow_special: bool = False) -> list[int]:
    """Token ids of a prompt: raw text to continue, or one user message in the model's chat template.

    Text such as ``<|im_end|>`` inside the prompt is read as plain text unless `allow_special`.
    """
    if not isinstance(prompt, str) or prompt == "":
        raise ValueError("prompt must be a non-empty string")
    check_unicode("prompt", prompt)
    split = not allow_special

    def tokens(text: str, split_special: bool, add_special: bool = False) -> list[int]:
        # transformers stores the flag in the tokenizer's shared backend before encoding; without the
        # lock, another thread's encode (another visitor of the app) could flip it in between and turn
        # this visitor's "<|im_start|>" text into a real control token.
        with _ENCODE_LOCK:
            return tokenizer(text, add_special_tokens=add_special, split_special_tokens=split_special).input_ids

    if not chat:  # the tokenizer adds what its model expects before raw text (Llama's BOS; SmolLM2 adds nothing)
        return tokens(prompt, split, add_special=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; turn chat off to continue raw text")
    # Render the template around a placeholder, so the template's own special tokens stay special
    # while the visitor's text is tokenized as text.
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                             add_generation_prompt=True)
    before, after = rendered.split(_MARK)
    return tokens(before, False) + tokens(prompt, split) + tokens(after, False)


class StopChecker:
    """Decides, one new token at a time, whether decoding ends after that token.

    Vanilla and SDSAT feed their tokens through the same checker, so a draft that runs past an
    end-of-sequence id, the token budget or a stop string is cut exactly where vanilla stops.
    """

    def __init__(self, tokenizer, eos_ids: Sequence[int], max_new_tokens: int, stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_strings = [s for s in stop_strings if s]
        self.tokens: list[int] = []
        self.reason: str | None = None

    def add(self, token: int) -> bool:
        """Record `token`; True when it is the last one."""
        self.tokens.append(token)
        if token in self.eos_ids:
            self.reason = "eos"
        elif self.stop_strings and self._hit_stop_string():
            self.reason = "stop_string"
        elif len(self.tokens) >= self.max_new_tokens:
            self.reason = "max_new_tokens"
        return self.reason is not None

    def _hit_stop_string(self) -> bool:
        # Only the tail can hold a new match: decode enough tokens to cover the longest stop string.
        longest = max(len(s) for s in self.stop_strings)
        tail = self.tokenizer.decode(self.tokens[-(longest + 8):], skip_special_tokens=False)
        return any(s in tail for s in self.stop_strings)


def eos_ids_of(model, tokenizer) -> list[int]:
    """Every end-of-sequence id of the model's generation config (and the tokenizer's)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else eos)
    return sorted(ids)


def encode_chat(tokenizer, messages: Sequence[dict], allow_special: bool = False) -> list[int]:
    """Token ids of a conversation in the model's chat template, ready for the assistant's next turn.

    `messages` are {"role": "system" | "user" | "assistant", "content": text} dicts. As in
    `encode_prompt`, the template's own special tokens stay special while every message's text is
    tokenized as text (``<|im_end|>`` typed by a visitor stays plain text unless `allow_special`).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use the Race tab to continue raw text")
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template([{"role": m["role"], "content": mark} for m, mark in zip(messages, marks)],
                                             tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    for message, mark in zip(messages, marks):
        before, rendered = rendered.split(mark, 1)
        ids += tokenizer(before, add_special_tokens=False, split_special_tokens=False).input_ids
        ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=not allow_special).input_ids
    return ids + tokenizer(rendered, add_special_tokens=False, split_special_tokens=False).input_ids
