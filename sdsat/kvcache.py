"""Surgery on the KV cache, in one place: a decoder owns its transformers `DynamicCache`, and only
these functions shrink it or move rows within it."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def rollback(cache: DynamicCache, length: int) -> None:
    """Shrink the cache to its first `length` tokens."""
    drop = cache.get_seq_length() - length
    if drop > 0:
        cache.crop(-drop)


def keep_rows(cache: DynamicCache, base: int, block: int, rows: list[int]) -> None:
    """Of the last `block` rows just added after `base`, keep `rows` (ascending offsets) at base, base + 1, ...

    Keys are stored after the rotary embedding, so a row keeps its position wherever it is moved. Rows
    are found from each layer's end, which also holds for layers that keep only a recent window.
    """
    if rows != list(range(len(rows))):
        index = torch.tensor(rows, device=cache.layers[0].keys.device)
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):
                first = kv.shape[-2] - block
                kv[..., first:first + len(rows), :] = kv[..., first + index, :]
    rollback(cache, base + len(rows))


def behind_cache(mask: torch.Tensor, cached: int, device: torch.device) -> torch.Tensor:
    """A block's (1, 1, T, T) boolean mask widened to (1, 1, T, cached + T): every row sees the whole cache."""
    mask = mask.to(device)
    return torch.cat([torch.ones(*mask.shape[:3], cached, dtype=torch.bool, device=device), mask], -1)
