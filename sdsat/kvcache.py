"""The KV cache, in one place: a decoder owns a transformers `DynamicCache` made by `new_cache`, and only
these functions shrink it or move rows within it."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 256  # tokens a layer's buffer grows by: a multiple of the row-invariant attention's key block


class InPlaceLayer(DynamicLayer):
    """A full-attention layer whose keys and values are written in place into a buffer grown GROW tokens at a
    time, not concatenated into new tensors at every pass; `keys` and `values` are views of its first tokens.

    Past them the buffer holds zeros or the keys of rows since dropped, all finite: the row-invariant attention
    reads that room, masked, as its key padding instead of copying the cache into a padded tensor per layer.
    """

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = self._value_buffer = None
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self._key_buffer is None or end + 1 > self._key_buffer.shape[-2]:  # room for one padding key at least
            self._grow(end + 1, key_states, value_states, start)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]
        return self.keys, self.values

    def _grow(self, tokens: int, key_states: torch.Tensor, value_states: torch.Tensor, kept: int) -> None:
        size = -(-tokens // GROW) * GROW
        buffers = []
        for old, new in ((self._key_buffer, key_states), (self._value_buffer, value_states)):
            buffer = new.new_zeros((*new.shape[:-2], size, new.shape[-1]))
            if old is not None and kept:
                buffer[..., :kept, :] = old[..., :kept, :]
            buffers.append(buffer)
        self._key_buffer, self._value_buffer = buffers


def new_cache(config) -> DynamicCache:
    """A `DynamicCache` for a model of `config` whose full-attention layers write in place (`InPlaceLayer`);
    sliding-window and other layers stay as transformers makes them."""
    cache = DynamicCache(config=config)
    cache.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


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
