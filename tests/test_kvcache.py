"""The decoder's KV cache writes in place (kvcache.InPlaceLayer) and decodes exactly as transformers' own."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from sdsat import attention, kvcache
from sdsat.tree import DraftTree

TREE = DraftTree.for_k(2, 2)  # a verify pass over a draft tree: nodes whose keys have gaps (gathered rows)


def _logits_through(model, cache, steps: list[tuple[str, object]]) -> list[torch.Tensor]:
    """Feed blocks and do surgery on `cache` as a decoder does; the logits of every block fed."""
    out = []
    with torch.inference_mode():
        for what, arg in steps:
            if what == "feed":
                ids = torch.tensor([arg])
                position = torch.arange(cache.get_seq_length(), cache.get_seq_length() + len(arg))[None]
                out.append(model(input_ids=ids, cache=cache, position_ids=position, use_cache=True).logits)
            elif what == "tree":
                cached = cache.get_seq_length()
                ids = torch.tensor([arg[:1 + len(TREE.paths)]])
                mask = kvcache.behind_cache(TREE.attention_mask, cached, ids.device)
                out.append(model(input_ids=ids, cache=cache, attention_mask=mask,
                                 position_ids=TREE.position_offsets + cached, use_cache=True).logits)
            elif what == "rollback":
                kvcache.rollback(cache, arg)
            else:  # keep rows (base, block, rows)
                kvcache.keep_rows(cache, *arg)
    return out


# A prefill, one-token passes, a rejected block rolled back, a draft tree's verify pass over room that holds
# rows since dropped, a block whose rows are kept out of order (a tree's accepted path), and growth past the
# first buffer (kvcache.GROW tokens).
STEPS = [("feed", list(range(3, 40))), ("feed", [7]), ("feed", [9, 11, 13, 2]), ("rollback", 39),
         ("tree", [5, 6, 8, 9, 10, 11, 12, 13]), ("rollback", 39),
         ("feed", [5, 6, 8]), ("keep", (40, 3, [0, 2])), ("feed", [4]),
         ("feed", [n % 60 + 2 for n in range(kvcache.GROW)]), ("feed", [3]), ("rollback", 100), ("feed", [8, 9])]


@pytest.mark.parametrize("implementation, dtype", [("sdpa", torch.float32), (attention.TILED, torch.float32),
                                                   (attention.PER_ROW, torch.float32),
                                                   (attention.KEYED, torch.bfloat16)])
def test_the_in_place_cache_gives_the_logits_of_transformers_cache_bit_for_bit(implementation: str, dtype,
                                                                               monkeypatch):
    attention.register()
    model = make_tiny_llama(layers=2).to(dtype)
    model.set_attn_implementation(implementation)
    roomy = []
    monkeypatch.setattr(attention, "has_room", lambda x, width: roomy.append(kvcache.has_room(x, width)) or roomy[-1])
    ours = _logits_through(model, kvcache.new_cache(model.config), STEPS)
    if implementation in (attention.TILED, attention.KEYED):  # the padding was read from the cache's own room
        assert roomy and all(roomy)
    roomy.clear()
    theirs = _logits_through(model, DynamicCache(config=model.config), STEPS)
    assert not any(roomy)  # transformers' tensors are copied: their memory past S is not the cache's
    assert len(ours) == len(theirs) == 9
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


def test_only_an_in_place_buffer_lends_its_room_and_replaced_keys_are_taken_over():
    model = make_tiny_llama(layers=1)
    cache = kvcache.new_cache(model.config)
    _logits_through(model, cache, [("feed", [2, 3, 4, 5])])
    layer = cache.layers[0]
    assert kvcache.has_room(layer.keys, 64)
    other = torch.full((1, 2, 100, 8), float("nan"))
    assert not kvcache.has_room(other[:, :, :10], 64)  # another tensor's memory, however large
    # transformers replaces the tensors (here by batch selection): the next pass builds on them, not on the buffer
    results = []
    for fresh in (kvcache.new_cache(model.config), DynamicCache(config=model.config)):
        with torch.inference_mode():
            model(input_ids=torch.tensor([[2, 3, 4, 5], [7, 8, 9, 10]]), cache=fresh, use_cache=True)
            fresh.batch_select_indices(torch.tensor([1]))
            results.append(model(input_ids=torch.tensor([[6]]), cache=fresh, position_ids=torch.tensor([[4]]),
                                 use_cache=True).logits)
    assert torch.equal(*results)
