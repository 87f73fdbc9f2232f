"""What the page may do: operator limits from the environment, and visitor settings checked against them.

The operator sets limits with environment variables (read once at start-up); a visitor's settings
are checked here before anything touches the model, and a bad one raises `SettingError` naming the
setting and its allowed range.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping

from ..decoding import MAX_LOOKUP_TOKENS, MAX_TREE_CANDIDATES, DecodeConfig
from ..models import DEFAULT_MODEL
from ..sampling import MIN_TEMPERATURE, SamplingConfig

MODES = ("greedy", "sampling")
MAX_SEED = 2**31 - 1
MAX_TEMPERATURE = 5.0
MAX_TOP_K = 1000
QUANTIZATIONS = ("none", "4bit", "8bit")
MAX_ITERATIONS = 100_000  # the explorer's slider: far above any race's iterations


class SettingError(ValueError):
    """A visitor's setting outside its allowed range; the message names the setting and the range."""


@dataclass
class Limits:
    """Operator limits; each field has an environment variable (see `from_env`)."""

    # SDSAT_MODELS: comma-separated, the first is the default
    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    max_new_tokens: int = 128  # SDSAT_MAX_NEW_TOKENS: per decoder and request
    max_prompt_tokens: int = 512  # SDSAT_MAX_PROMPT_TOKENS
    max_prompt_chars: int = 8000  # SDSAT_MAX_PROMPT_CHARS: checked before tokenizing
    time_limit_s: float = 90.0  # SDSAT_TIME_LIMIT: wall seconds per request; each decoder gets half
    concurrency: int = 1  # SDSAT_CONCURRENCY: requests decoding at once (one shared model)
    queue_size: int = 32  # SDSAT_QUEUE_SIZE: requests waiting beyond that are turned away (a burst of 20 waits)
    # A finished race is kept for its visitor's explorer and replay (about 270 KB): for this long after
    # the visitor's last race, and for at most this many visitors, the oldest dropped first.
    state_ttl_s: float = 1800.0  # SDSAT_STATE_TTL
    max_sessions: int = 1000  # SDSAT_MAX_SESSIONS
    device: str = "auto"  # SDSAT_DEVICE: auto, cpu, cuda or mps
    dtype: str = "auto"  # SDSAT_DTYPE: auto, float32, float16 or bfloat16 (auto: a known checkpoint's own on a GPU)
    quantization: str | None = None  # SDSAT_QUANTIZATION: none, 4bit or 8bit (bitsandbytes, CUDA only)
    load_retry_s: float = 10.0  # SDSAT_LOAD_RETRY_S: after a failed model load, requests get its reason at once
    # for this long; the first one after it tries again

    @property
    def gpu_duration_s(self) -> int:
        """The GPU time a ZeroGPU Space books per request: the request's time limit, plus room to move the
        weights onto the GPU and to render."""
        return math.ceil(self.time_limit_s) + 15

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Limits":
        env = os.environ if env is None else env
        limits = cls()
        models = [m.strip() for m in env.get("SDSAT_MODELS", "").split(",") if m.strip()]
        if models:
            limits.models = list(dict.fromkeys(models))
        for name, attr, kind, low in (
            ("SDSAT_MAX_NEW_TOKENS", "max_new_tokens", int, 1),
            ("SDSAT_MAX_PROMPT_TOKENS", "max_prompt_tokens", int, 1),
            ("SDSAT_MAX_PROMPT_CHARS", "max_prompt_chars", int, 1),
            ("SDSAT_TIME_LIMIT", "time_limit_s", float, 1),
            ("SDSAT_CONCURRENCY", "concurrency", int, 1),
            ("SDSAT_QUEUE_SIZE", "queue_size", int, 1),
            ("SDSAT_LOAD_RETRY_S", "load_retry_s", float, 0),
            ("SDSAT_STATE_TTL", "state_ttl_s", float, 1),
            ("SDSAT_MAX_SESSIONS", "max_sessions", int, 1),
        ):
            if name in env:
                try:
                    value = kind(env[name])
                except ValueError:
                    raise ValueError(f"{name} must be a number, got {env[name]!r}") from None
                if not value >= low:
                    raise ValueError(f"{name} must be at least {low}, got {value}")
                setattr(limits, attr, value)
        limits.device = env.get("SDSAT_DEVICE", limits.device)
        limits.dtype = env.get("SDSAT_DTYPE", limits.dtype)
        quantization = env.get("SDSAT_QUANTIZATION", "none").strip().lower()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"SDSAT_QUANTIZATION must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        limits.quantization = None if quantization == "none" else quantization
        return limits


@dataclass
class RunRequest:
    """One visitor request, after checking: the prompt and both decoders' configs."""

    prompt: str
    model: str
    chat: bool
    mode: str  # "greedy" or "sampling"
    k: int
    max_new_tokens: int
    sampling: SamplingConfig
    lookup_tokens: int = 0  # SDSAT verifies up to this many prompt-lookup copies where the text recurs; 0: off
    tree_candidates: int = 0  # greedy SDSAT also verifies this many of the SATs' runner-ups (a draft tree); 0: off

    def decode_config(self, method: str) -> DecodeConfig:
        # Each decoder gets its own SamplingConfig: the engine seeds a generator from it per request.
        sampling = SamplingConfig(**vars(self.sampling))
        return DecodeConfig(method=method, k=self.k, max_new_tokens=self.max_new_tokens, sampling=sampling,
                            lookup_tokens=self.lookup_tokens if method == "sdsat" else 0,
                            tree_candidates=self.tree_candidates if method == "sdsat" else 0)

    def settings(self) -> dict:
        return {"model": self.model, "chat": self.chat, "mode": self.mode, "k": self.k,
                "max_new_tokens": self.max_new_tokens, "lookup_tokens": self.lookup_tokens,
                "tree_candidates": self.tree_candidates} | (
            {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
             "top_k": self.sampling.top_k, "seed": self.sampling.seed} if self.mode == "sampling" else {})


def _integer(name: str, value, low: int, high: int) -> int:
    """`value` as an int in [low, high]; floats and numeric strings must be whole numbers \
(API callers send anything)."""
    wrong = SettingError(f"{name} must be a whole number between {low} and {high}, got {_shown(value)}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise wrong from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # bool is an int to Python, not to a visitor
        raise wrong
    if isinstance(value, float):
        # -0.0, NaN, inf and 1e300 are floats; an int of any size is compared exactly, never through float().
        if not math.isfinite(value) or value != int(value):
            raise wrong
        value = int(value)
    if not low <= value <= high:
        raise SettingError(f"{name} must be between {low} and {high}, got {_shown(value)}")
    return value


def _real(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] (or (low, high] when `low_open`)."""
    bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SettingError(f"{name} must be a number in {bound}, got {_shown(value)}")
    try:
        value = float(value)
    except (ValueError, OverflowError):  # "abc", or an int beyond float's range
        raise SettingError(f"{name} must be a number in {bound}, got {_shown(value)}") from None
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise SettingError(f"{name} must be in {bound}, got {value}")
    return value


def _flag(name: str, value) -> bool:
    """A checkbox: only a JSON boolean (or the strings "true" / "false"); bool("false") would be True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise SettingError(f"{name} must be true or false, got {_shown(value)}")


def _shown(value, limit: int = 60) -> str:
    """A visitor's value for an error message: its repr, cut short (a 1 MB list must not come back)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        # counted from its bits: str() of an int beyond 4300 digits raises in Python 3.11
        return (f"a {len(str(abs(value)))}-digit number" if value.bit_length() < 14000
                else "a number of over 4000 digits")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def check_flag(name: str, value) -> bool:
    """A page checkbox other than the request's own (show rejected drafts)."""
    return _flag(name, value)


def check_iteration(value) -> int:
    """The explorer's slider: a whole number from 1 (the handler clamps it to the race it shows, which may
    have expired since the slider was drawn)."""
    return _integer("iteration", value, 1, MAX_ITERATIONS)


def check_request(limits: Limits, max_k: int | None, *, prompt, model, chat, mode, k, max_new_tokens,
                  temperature, top_p, top_k, seed, lookup_tokens=0, tree_candidates=0) -> RunRequest:
    """Check every setting a visitor sent, by type and range; raises SettingError naming the first bad one.

    Every setting is checked whatever the mode, so a value the request ignores (the temperature of a
    greedy run) is still refused when it is not a valid value. `max_k` is the chosen model's largest k
    (None: not known yet, checked again once it is loaded).
    """
    if not isinstance(model, str) or model not in limits.models:
        raise SettingError(f"model must be one of: {', '.join(limits.models)} (set by the operator); "
                           f"got {_shown(model)}")
    if not isinstance(prompt, str):
        raise SettingError(f"prompt must be text, got {_shown(prompt)}")
    if prompt == "":
        raise SettingError("prompt is empty: type some text for the model to continue")
    if len(prompt) > limits.max_prompt_chars:
        raise SettingError(f"prompt must be at most {limits.max_prompt_chars} characters, got {len(prompt)}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, as JSON's "\ud800" decodes to
        raise SettingError(f"prompt must be valid Unicode text; "
                           f"it has an unpaired surrogate at character {err.start}") from None
    chat = _flag("chat", chat)
    if not isinstance(mode, str) or mode not in MODES:
        raise SettingError(f"mode (decoding) must be one of {', '.join(MODES)}, got {_shown(mode)}")
    k = _integer("k (adaptive tokens per step)", k, 1, max_k or 64)
    max_new_tokens = _integer("max new tokens", max_new_tokens, 1, limits.max_new_tokens)
    lookup_tokens = _integer("prompt lookup tokens", lookup_tokens, 0, MAX_LOOKUP_TOKENS)
    tree_candidates = _integer("draft tree candidates", tree_candidates, 0, MAX_TREE_CANDIDATES)
    sampled = SamplingConfig(do_sample=True,
                             temperature=_real("temperature", temperature, MIN_TEMPERATURE, MAX_TEMPERATURE),
                             top_p=_real("top-p", top_p, 0.0, 1.0, low_open=True),
                             top_k=_integer("top-k", top_k, 0, MAX_TOP_K),
                             seed=_integer("seed", seed, 0, MAX_SEED))
    sampling = SamplingConfig()
    if mode == "sampling":
        sampling = sampled
        tree_candidates = 0  # a draft tree is greedy only: sampling verifies the chain, and the record says so
    return RunRequest(prompt=prompt, model=model, chat=chat, mode=mode, k=k, max_new_tokens=max_new_tokens,
                      sampling=sampling, lookup_tokens=lookup_tokens, tree_candidates=tree_candidates)


def check_prompt_ids(limits: Limits, prompt_ids: list[int], request: RunRequest, max_context: int | None) -> None:
    """The encoded prompt fits the operator's limit and, with the new tokens and SATs, the model's context."""
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise SettingError(f"prompt must be at most {limits.max_prompt_tokens} tokens, got {len(prompt_ids)}")
    if not prompt_ids:
        raise SettingError("prompt is empty after tokenizing: type some text for the model to continue")
    try:  # the SDSAT decoder's rule: it feeds more positions than vanilla's
        request.decode_config("sdsat").check_context(len(prompt_ids), max_context)
    except ValueError as err:
        raise SettingError(str(err)) from None
