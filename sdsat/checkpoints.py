"""Known SDSAT checkpoints: models whose SATs are rows of their own vocabulary, published without a sat_spec.json.

The table is looked up for hub ids and for folders alike: a folder matches by its name (a clone of
the repository) or by huggingface_hub's cache layout (``models--{org}--{name}/snapshots/{revision}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownCheckpoint:
    repo: str  # the hub id
    sat_id: int  # the vocabulary row every SAT uses (repeated k times)
    max_k: int  # the most SATs per step it was trained with
    dtype: str  # the dtype it was published in; "auto" loads it so on a GPU (a CPU computes in float32)
    chat: bool  # whether it is meant to be prompted through a chat template


# The paper's CodeLlama checkpoints (arXiv 2403.18647): SAT id 32011 up to 15 times, fp16, BOS as the
# tokenizer adds it, code completion without a chat template.
KNOWN_CHECKPOINTS = (
    KnownCheckpoint("ainergy/CodeLlama-SDSAT_L5_7B", sat_id=32011, max_k=15, dtype="float16", chat=False),
    KnownCheckpoint("ainergy/CodeLlama-SDSAT_L7_13B", sat_id=32011, max_k=15, dtype="float16", chat=False),
)


def known_checkpoint(model: str) -> KnownCheckpoint | None:
    """The table's entry for a hub id or a folder holding one of its checkpoints; None if none."""
    name = model.strip().rstrip("/").lower()
    parts = [p.lower() for p in Path(name).parts]
    for checkpoint in KNOWN_CHECKPOINTS:
        repo = checkpoint.repo.lower()
        if name == repo or (parts and parts[-1] == repo.split("/")[1]):
            return checkpoint
        if "models--" + repo.replace("/", "--") in parts:
            return checkpoint
    return None
