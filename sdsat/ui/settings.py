"""What the page may do: operator limits from the environment, and a visitor's request parsed into one object.

The operator sets limits with environment variables (read once at start-up). A visitor's request is
parsed here into a `RunRequest` holding a `DecodeConfig`; the page checks only what it alone knows
(the operator's models, the prompt), and `DecodeConfig.validate` checks every decoder setting once the
model is loaded. A bad setting raises `SettingError` naming the setting and its allowed range.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from ..config import DecodeConfig
from ..errors import check_whole, shown
from ..models import DEFAULT_MODEL
from ..prompts import check_unicode
from ..sampling import MAX_SEED, SamplingConfig

MODES = ("greedy", "sampling")
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
    quiet_wait_s: float = 3600.0  # SDSAT_QUIET_WAIT_S: how long a tuning kept from a busy spell waits for a quiet
    # machine to be measured again behind the page (0: never measured again by the app)

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
            ("SDSAT_QUIET_WAIT_S", "quiet_wait_s", float, 0),
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


# A visitor's request, by name: the parameters of /generate (Page.generate spells them out, for Gradio reads
# the API's schema from its signature) and of the Chat tab's turns, whose message is the prompt.
REQUEST_INPUTS = ("prompt", "model", "chat", "mode", "k", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                  "lookup_tokens", "tree_candidates")


def request_inputs(values: Mapping) -> dict:
    """The REQUEST_INPUTS in `values` (an API handler's `locals()`), by name."""
    return {name: values[name] for name in REQUEST_INPUTS if name in values}


@dataclass
class RunRequest:
    """One visitor request: what only the page checks, and the SDSAT decoder's config (vanilla's is derived).

    `parse_request` builds it before the model is loaded; `validate` checks every decoder setting once it is.
    """

    prompt: str
    model: str  # one of the operator's models
    chat: bool  # the prompt goes through the model's chat template
    config: DecodeConfig  # SDSAT's; its sampling holds the visitor's values even when greedy (do_sample off)

    @property
    def mode(self) -> str:
        return "sampling" if self.config.sampling.do_sample else "greedy"

    def validate(self, limits: Limits, max_k: int) -> None:
        """Every decoder setting against its range (DecodeConfig.validate, the only home of the ranges);
        raises SettingError naming the first bad one. Every setting is checked whatever the mode, so a
        value the request ignores (the temperature of a greedy run) is still refused when it is not valid."""
        try:
            self.config.validate(max_k, max_new_tokens_limit=limits.max_new_tokens)
            replace(self.config.sampling, do_sample=True).validate()
        except ValueError as err:
            raise SettingError(str(err)) from None

    def decode_config(self, method: str) -> DecodeConfig:
        # Each decoder gets its own SamplingConfig: the engine seeds a generator from it per request.
        config = replace(self.config, sampling=replace(self.config.sampling))
        return config if method == "sdsat" else replace(config, method=method, lookup_tokens=0, tree_candidates=0)

    def settings(self) -> dict:
        """The settings as the API reports them: what the decoders used (no draft tree under sampling)."""
        config, sampling = self.config, self.config.sampling
        return {"model": self.model, "chat": self.chat, "mode": self.mode, "k": config.k,
                "max_new_tokens": config.max_new_tokens, "lookup_tokens": config.lookup_tokens,
                "tree_candidates": config.tree_candidates} | (
            {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
             "seed": sampling.seed} if sampling.do_sample else {})


def _integer(value):
    """An API caller's whole number as an int: an int, a whole float or a string of one ("4", "4.0").
    Anything else comes back as it is, for the config's check to refuse with the setting's range."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    # -0.0, NaN, inf and 1e300 are floats; an int of any size stays exact, never passing through float().
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return value


def _real(value):
    """An API caller's number as a float: an int, a float or a string of one. Anything else (a bool, a list,
    an int beyond float's range) comes back as it is, for the config's check to refuse with the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return value
    try:
        return float(value)
    except (ValueError, OverflowError):  # "abc", or an int beyond float's range
        return value


def _flag(name: str, value) -> bool:
    """A checkbox: only a JSON boolean (or the strings "true" / "false"); bool("false") would be True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise SettingError(f"{name} must be true or false, got {shown(value)}")


def check_flag(name: str, value) -> bool:
    """A page checkbox other than the request's own (show rejected drafts)."""
    return _flag(name, value)


def check_iteration(value) -> int:
    """The explorer's slider: a whole number from 1 (the handler clamps it to the race it shows, which may
    have expired since the slider was drawn)."""
    value = _integer(value)
    try:
        check_whole("iteration", value, 1, MAX_ITERATIONS)
    except ValueError as err:
        raise SettingError(str(err)) from None
    return value


def _check_prompt(limits: Limits, prompt) -> str:
    if not isinstance(prompt, str):
        raise SettingError(f"prompt must be text, got {shown(prompt)}")
    if prompt == "":
        raise SettingError("prompt is empty: type some text for the model to continue")
    if len(prompt) > limits.max_prompt_chars:
        raise SettingError(f"prompt must be at most {limits.max_prompt_chars} characters, got {len(prompt)}")
    try:
        return check_unicode("prompt", prompt)
    except ValueError as err:  # a lone surrogate, as JSON's "\ud800" decodes to
        raise SettingError(str(err)) from None


def parse_request(limits: Limits, inputs: Mapping) -> RunRequest:
    """A visitor's request from `inputs` (REQUEST_INPUTS by name, as the page or an API caller sent them).

    Checks what only the page knows: the model is on the operator's list, the prompt is text within its
    limit, chat is a boolean and mode a known one. Numbers are parsed (API callers send strings, whole
    floats, ints of any size); their ranges wait for `RunRequest.validate`, once the model is loaded.
    Raises SettingError naming the first bad setting.
    """
    model = inputs["model"]
    if not isinstance(model, str) or model not in limits.models:
        raise SettingError(f"model must be one of: {', '.join(limits.models)} (set by the operator); "
                           f"got {shown(model)}")
    prompt = _check_prompt(limits, inputs["prompt"])
    chat = _flag("chat", inputs["chat"])
    mode = inputs["mode"]
    if not isinstance(mode, str) or mode not in MODES:
        raise SettingError(f"mode (decoding) must be one of {', '.join(MODES)}, got {shown(mode)}")
    if inputs["seed"] is None:  # the config's "draw a fresh seed": a page's run is repeatable
        raise SettingError(f"seed must be a whole number between 0 and {MAX_SEED}, got None")
    sampling = SamplingConfig(do_sample=mode == "sampling", temperature=_real(inputs["temperature"]),
                              top_p=_real(inputs["top_p"]), top_k=_integer(inputs["top_k"]),
                              seed=_integer(inputs["seed"]))
    config = DecodeConfig(method="sdsat", k=_integer(inputs["k"]), max_new_tokens=_integer(inputs["max_new_tokens"]),
                          sampling=sampling, lookup_tokens=_integer(inputs["lookup_tokens"]),
                          tree_candidates=_integer(inputs["tree_candidates"]))
    return RunRequest(prompt=prompt, model=model, chat=chat, config=config)


def check_prompt_ids(limits: Limits, prompt_ids: list[int], request: RunRequest, max_context: int | None) -> None:
    """The encoded prompt fits the operator's limit and, with the new tokens and SATs, the model's context."""
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise SettingError(f"prompt must be at most {limits.max_prompt_tokens} tokens, got {len(prompt_ids)}")
    if not prompt_ids:
        raise SettingError("prompt is empty after tokenizing: type some text for the model to continue")
    try:  # the SDSAT decoder's rule: it feeds more positions than vanilla's
        request.config.check_context(len(prompt_ids), max_context)
    except ValueError as err:
        raise SettingError(str(err)) from None
