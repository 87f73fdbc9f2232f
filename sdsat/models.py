"""Loading models: the embedded default (`default_model.py`), hub ids and local folders.

Hub ids download through transformers (huggingface_hub underneath), so HF_HUB_OFFLINE and
HF_ENDPOINT apply as everywhere else; the caller decides whether the Hub may be reached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from .checkpoints import known_checkpoint
from .default_model import DEFAULT_MODEL, DefaultModelError, cache_dir, default_model_folder
from .errors import first_line

log = logging.getLogger(__name__)

_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadConfig:
    """How to load a model; the CLI and the app fill this in."""

    model: str = DEFAULT_MODEL  # the embedded default, a hub id, or a local folder
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA), float32, float16 or bfloat16
    device: str = "auto"  # auto, cpu, cuda or mps
    quantization: str | None = None  # None, "4bit" or "8bit" (bitsandbytes, CUDA only)
    trust_remote_code: bool = False  # only an operator may turn this on
    cpu_kernels: bool = True  # on a CPU, route small-batch products to the fastest measured kernel (cpu_kernels.py)
    # with cpu_kernels: measure the routing at load when none is kept for this machine (seconds to minutes);
    # False: route with a kept plan only, else load with plain products (the app and CLI measure later, or never)
    measure_kernels: bool = True


class ModelLoadError(ValueError):
    """A model that cannot be loaded, with a message a user can act on."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"device must be one of auto, cpu, cuda, mps; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, model: str = "") -> torch.dtype:
    """The dtype to load `model` in: "auto" is float32 on a CPU, else a known checkpoint's own or bfloat16."""
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    checkpoint = known_checkpoint(model)
    return _DTYPES[checkpoint.dtype] if checkpoint else torch.bfloat16


def load_model(config: LoadConfig | None = None):
    """Load (model, tokenizer) in eval mode.

    Raises:
        ModelLoadError: the model id or folder is unknown, unreadable, or needs what is missing.
    """
    config = config or LoadConfig()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, config.model)
    kwargs: dict = dict(dtype=dtype, trust_remote_code=config.trust_remote_code, use_safetensors=True)
    if config.quantization is not None:
        kwargs["quantization_config"] = _bitsandbytes_config(config.quantization, device)
        kwargs["device_map"] = {"": device.index or 0}
    if config.model == DEFAULT_MODEL:
        model, tokenizer = _load_default(kwargs)
    else:
        model, tokenizer = _load(config.model, _source(config.model), kwargs)
    if config.quantization is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if config.cpu_kernels and device.type == "cpu":
        from . import cpu_kernels

        plan = cpu_kernels.tune(model, cache_file=cache_dir() / cpu_kernels.PLAN_FILE, measure=config.measure_kernels)
        if plan is not None:
            log.info("CPU kernels: %d linear layers routed (tuned in %.1f s)", cpu_kernels.install(model, plan),
                     plan.seconds)
    return model, tokenizer


def _source(model: str) -> str:
    """`model` checked as a folder where it names one (a hub id passes through)."""
    # A path that is not there would otherwise be read as a hub id, with a confusing message.
    if model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
        raise ModelLoadError(f"cannot load model {model!r}: no such folder")
    folder = Path(model).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ModelLoadError(f"cannot load model {model!r}: the folder has no config.json (not a saved model)")
    # Weights load through safetensors only: pickle files (pytorch_model.bin) can run code when loaded.
    if folder.is_dir() and not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"cannot load model {model!r}: the folder has no .safetensors weights "
                             "(pickle weights such as pytorch_model.bin are refused; convert them to safetensors)")
    return str(folder) if folder.is_dir() else model


def _load_default(kwargs: dict):
    """The embedded default; a cache that fails to load although its manifest matched is rebuilt once."""
    from .default_model import rebuild_default_model

    try:
        return _load(DEFAULT_MODEL, str(default_model_folder()), kwargs)
    except DefaultModelError as err:
        raise ModelLoadError(f"cannot load the default model: {err}") from None
    except ModelLoadError as err:
        log.warning("the default model's cache did not load (%s); rebuilding it", err)
    try:
        return _load(DEFAULT_MODEL, str(rebuild_default_model()), kwargs)
    except DefaultModelError as err:
        raise ModelLoadError(f"cannot load the default model: {err}") from None


def _load(name: str, source: str, kwargs: dict):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=kwargs["trust_remote_code"])
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise ModelLoadError(f"cannot load model {name!r}: {first_line(err)}") from err
    return model, tokenizer


def _bitsandbytes_config(quantization: str, device: torch.device):
    if quantization not in ("4bit", "8bit"):
        raise ModelLoadError(f"quantization must be '4bit' or '8bit'; got {quantization!r}")
    if device.type != "cuda":
        raise ModelLoadError("4-bit / 8-bit loading uses bitsandbytes, which needs a CUDA GPU")
    try:
        import bitsandbytes  # noqa: F401  (imported lazily: it only works with CUDA)
    except ImportError as err:
        raise ModelLoadError("4-bit / 8-bit loading needs bitsandbytes: pip install bitsandbytes") from err
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4")
    return BitsAndBytesConfig(load_in_8bit=True)
