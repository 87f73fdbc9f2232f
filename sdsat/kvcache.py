"""The KV cache, in one place: a decoder owns a transformers `DynamicCache` made by `new_cache`, and only
these functions shrink it or move rows within it."""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 256  # tokens a layer's buffer grows by: a multiple of the row-invariant attention's key block
_ROOMY: set[int] = set()  # storages of live InPlaceLayer buffers: only their room is read as padding


class InPlaceLayer(DynamicLayer):
    """A full-attention layer whose keys and values are written in place into a buffer grown GROW tokens at a
    time, not concatenated into new tensors at every pass; `keys` and `values` are views of its first tokens.

    Past them the buffer holds zeros or the keys of rows since dropped, all finite: the row-invariant attention
    reads that room, masked, as its key padding (`has_room`) instead of padding a copy of the cache in every
    layer (the keyed form still copies its keys dense, padding included, for its scores' product). Being
    written in place, a cache filled under `torch.inference_mode` takes its later passes
    (and `keep_rows`) under it too, as the decoders run them. Where transformers replaces `keys` and `values`
    with new tensors (batch selection, offloading), the next update starts a new buffer from them.
    """

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = self._value_buffer = None
        elif self._key_buffer is not None and not _same_storage(self.keys, self._key_buffer):
            self._key_buffer = self._value_buffer = None  # replaced by transformers: taken over below
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self._key_buffer is None or end + 1 > self._key_buffer.shape[-2]:  # room for one padding key at least
            self._grow(end + 1, key_states, value_states, start)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()

    def _grow(self, tokens: int, key_states: torch.Tensor, value_states: torch.Tensor, kept: int) -> None:
        """New buffers of at least `tokens` rows holding the first `kept` rows of `keys` and `values`."""
        size = -(-tokens // GROW) * GROW
        buffers = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = new.new_zeros((*new.shape[:-2], size, new.shape[-1]))
            if kept:
                buffer[..., :kept, :] = old[..., :kept, :]
            pointer = buffer.untyped_storage().data_ptr()
            _ROOMY.add(pointer)
            weakref.finalize(buffer, _ROOMY.discard, pointer)
            buffers.append(buffer)
        self._key_buffer, self._value_buffer = buffers


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def has_room(x: torch.Tensor, width: int) -> bool:
    """Whether (B, H, S, D) `x` is the first S rows of an InPlaceLayer buffer with at least `width` rows per head:
    the rows past S are then finite (zeros, or rows since dropped), never another tensor's memory."""
    d, heads = x.shape[-1], x.shape[1]
    end = x.storage_offset() + (heads - 1) * x.stride(1) + width * d  # one past head H - 1's row `width`
    return (x.untyped_storage().data_ptr() in _ROOMY and x.stride(3) == 1 and x.stride(2) == d
            and x.stride(1) >= width * d and end <= x.untyped_storage().nbytes() // x.element_size())


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
