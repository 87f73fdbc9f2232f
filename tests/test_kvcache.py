"""The decoder's KV cache writes in place (kvcache.InPlaceLayer) and decodes exactly as transformers' own."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from sdsat import attention, kvcache


def _logits_through(model, cache, steps: list[tuple[str, object]]) -> list[torch.Tensor]:
    """Feed blocks and do surgery on `cache` as a decoder does; the logits of every block fed."""
    out = []
    with torch.inference_mode():
        for what, arg in steps:
            if what == "feed":
                ids = torch.tensor([arg])
                position = torch.arange(cache.get_seq_length(), cache.get_seq_length() + len(arg))[None]
                out.append(model(input_ids=ids, cache=cache, position_ids=position, use_cache=True).logits)
            elif what == "rollback":
                kvcache.rollback(cache, arg)
            else:  # keep rows (base, block, rows)
                kvcache.keep_rows(cache, *arg)
    return out


# A prefill, one-token passes, a rejected block rolled back, a block whose rows are kept out of order (a tree's
# accepted path), and growth past the first buffer (kvcache.GROW tokens).
STEPS = [("feed", list(range(3, 40))), ("feed", [7]), ("feed", [9, 11, 13, 2]), ("rollback", 39),
         ("feed", [5, 6, 8]), ("keep", (40, 3, [0, 2])), ("feed", [4]),
         ("feed", [n % 60 + 2 for n in range(kvcache.GROW)]), ("feed", [3]), ("rollback", 100), ("feed", [8, 9])]


@pytest.mark.parametrize("implementation, dtype", [("sdpa", torch.float32), (attention.TILED, torch.float32),
                                                   (attention.PER_ROW, torch.float32),
                                                   (attention.KEYED, torch.bfloat16)])
def test_the_in_place_cache_gives_the_logits_of_transformers_cache_bit_for_bit(implementation: str, dtype):
    attention.register()
    model = make_tiny_llama(layers=2).to(dtype)
    model.set_attn_implementation(implementation)
    ours = _logits_through(model, kvcache.new_cache(model.config), STEPS)
    theirs = _logits_through(model, DynamicCache(config=model.config), STEPS)
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_the_in_place_cache_grows_in_blocks_and_otherwise_writes_where_it_is():
    model = make_tiny_llama(layers=1)
    cache = kvcache.new_cache(model.config)
    assert all(type(layer) is kvcache.InPlaceLayer for layer in cache.layers)
    _logits_through(model, cache, [("feed", [2, 3, 4])])
    layer = cache.layers[0]
    buffer = layer.keys.untyped_storage().data_ptr()
    _logits_through(model, cache, [("feed", [5])] * 10 + [("rollback", 6), ("feed", [6, 7])])
    assert layer.keys.untyped_storage().data_ptr() == buffer  # no new tensor while the buffer has room
    assert cache.get_seq_length() == 8 and layer.keys.shape[-2] == 8
    _logits_through(model, cache, [("feed", [5] * kvcache.GROW)])
    assert layer.keys.shape[-2] == 8 + kvcache.GROW  # grown to the next multiple of GROW past it
    assert layer.keys.untyped_storage().nbytes() == layer.keys[..., :1, :].numel() * 2 * kvcache.GROW * 4
