"""Row-invariant attention: a row of a block comes out bit for bit as the same token computed alone.

Greedy SDSAT reproduces vanilla decoding only if a token's logits come out the same whether it is
computed alone (vanilla) or as one row of a verify block. Batched attention breaks that: a block's
row also "sees" the keys masked out for it, so its softmax sum and its product with the values run
over a longer axis than the same row alone, and the kernels pick their order of operations by the
shapes (how many rows, how many keys, how the threads split them). Four ways around it:

* Tiled (`TILED`): every attention call has the same shape, whatever the block. Rows go in tiles of
  `TILE_ROWS` (a short tile padded with zero queries); a row's keys are padded, masked, to the next
  multiple of `KEY_BLOCK` of the keys it sees, and rows whose counts round to another multiple go in
  another call. A row of a block and the same token alone then run one kernel on one shape, and the
  keys masked for it add exact zeros. A draft tree's nodes off the chain see keys with gaps: each gets
  a tile of its own whose keys are its own gathered into a prefix, and those tiles go in one batched
  call (the same products, more of them). Off the kernels' guarantees, so the tuner checks it on each
  machine (costs.check_rows) before using it. A few calls per layer, however many rows.
* Keyed (`KEYED`): bfloat16 only (other dtypes take the tiled form). Rows are cut only where their padded
  key counts differ, with no padding queries: a lone row costs one row's products, a block a few calls
  per layer. It rests on bfloat16 batched products (oneDNN's on CPUs with AVX-512 BF16 or AMX) giving a
  row the same bits whatever the number of rows beside it, which float32's BLAS does not; the tuner checks
  it per machine like the tiled form. Its numerics are eager attention's in bfloat16: scores and the
  weighted values are bfloat16 products, the softmax runs in float32.
* Per row (`PER_ROW`): each row attends over exactly the keys it sees, alone. Invariant wherever one
  kernel call is deterministic, but one call per row and layer: the fallback.
* Compiled (`COMPILED`): the per-row idea in one call per layer, `csrc/attend.cpp` compiled on the machine
  (native.py): every row over exactly its keys, its sums in one fixed order, so invariant by construction and
  with no padding; a lone row costs a fraction of the other forms' setup. float32 arithmetic on float32 or
  bfloat16 inputs. Offered only where the extension is built; models it does not take (soft-capped scores,
  other head sizes) attend one row at a time, as the per-row form does, in every pass alike.

All four cut a draft tree's node to its own keys (the cache, then its ancestors) before attending. The tiled and
keyed forms run on one thread whatever torch's thread count: their products are a few thousand multiply-adds
per head, less than what handing half of them to a second core costs (on 2 busy cores a one-row pass's
attention took 2 to 3 times as long on two threads as on one). Their results do not depend on it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from . import native
from .kvcache import has_room

TILED, KEYED, PER_ROW, COMPILED = "sdsat_tiled", "sdsat_keyed", "sdsat_row_invariant", "sdsat_compiled"
TILE_ROWS = 8  # query rows per call
KEY_BLOCK = 64  # keys are padded to a multiple of this


def _check(query: torch.Tensor) -> None:
    if query.shape[0] != 1:
        raise ValueError("row-invariant attention decodes one sequence at a time")


def _as_float(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # CPUs without half-precision attention kernels take a slow path; float32 is also what the lone row uses
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def _seen(attention_mask: torch.Tensor, t: int) -> torch.Tensor:
    """Indices of the keys row t sees, from a boolean (True: seen) or additive (0: seen) mask."""
    row = attention_mask[0, 0, t]
    return (row if row.dtype == torch.bool else row == 0).nonzero().squeeze(-1)


def _soft_capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping, in place: scores = softcap * tanh(scores / softcap)."""
    return scores.div_(softcap).tanh_().mul_(softcap)


def _capped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
            softcap: float) -> torch.Tensor:
    """One row's attention with soft-capped scores (SDPA has no soft-capping): (1, H, 1, D) over (1, Hkv, S, D)."""
    kv_heads, group = key.shape[1], query.shape[1] // key.shape[1]
    q = query[0].reshape(kv_heads, group, query.shape[-1])
    scores = _soft_capped(torch.bmm(q, key[0].transpose(1, 2)).mul_(scaling), softcap)
    return torch.bmm(torch.softmax(scores, -1), value[0]).reshape(1, -1, 1, query.shape[-1])


def per_row_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: query (B, H, T, D), key/value (B, Hkv, S, D), a boolean (True: seen) or
    additive mask (B, 1, T, S) or None (causal); returns (B, T, H, D) and no weights. One sequence per batch."""
    _check(query)
    softcap = kwargs.get("softcap")
    dtype = query.dtype
    rows, keys = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    query, key, value = _as_float(query, key, value)
    outs = []
    for t in range(rows):
        if attention_mask is None:  # causal: the keys up to this row's own
            k, v = key[:, :, :keys - rows + t + 1], value[:, :, :keys - rows + t + 1]
        else:
            seen = _seen(attention_mask, t)
            if int(seen[-1]) + 1 == seen.numel():  # a prefix of the keys: a view, no copy
                k, v = key[:, :, :seen.numel()], value[:, :, :seen.numel()]
            else:  # a draft tree's node: the cache, then its ancestors
                k, v = key.index_select(2, seen), value.index_select(2, seen)
        q = query[:, :, t:t + 1]
        outs.append(_capped(q, k, v, scaling, softcap) if softcap else
                    F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa))
    out = outs[0] if rows == 1 else torch.cat(outs, dim=2)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def _padded(n: int) -> int:
    return -(-n // KEY_BLOCK) * KEY_BLOCK


KEEP_MASKS = 16  # a layout of at most this many tiles (a decode pass, a tree's nodes included) keeps its
# masks for every layer
GATHER_ROWS = 32  # gathered rows per batched call: a sliding window's prefill gathers a window per row


@dataclass
class _Tile:
    first: int  # rows first..last-1 of the block
    last: int
    counts: list[int]  # keys each row sees; the tile's padding rows see one
    keys: int  # the padded key count: a multiple of KEY_BLOCK
    mask: torch.Tensor | None = None  # kept from `_tile_mask` in small layouts, else made at each call


@dataclass
class _Gathered:
    """Rows whose keys have gaps (a draft tree's nodes off the chain), one tile each, in one batched call."""

    rows: torch.Tensor  # (m,) their rows in the block
    index: torch.Tensor  # (m * keys,) each row's keys (the cache, its ancestors, itself), then a padding key
    tiles: list[_Tile]  # one per row, as the same token alone would have: row 0 real, padded to `keys`
    keys: int  # the padded key count shared by these rows
    mask: torch.Tensor | None = None  # (kv_heads * m, group * TILE_ROWS, keys), kept in small layouts


@dataclass
class _Layout:
    """How one pass's rows are cut into calls: the same for every layer of the pass, so made once."""

    tiles: list[_Tile]
    gathered: list[_Gathered]
    keys: int  # the widest padded key count


def _tile_mask(tile: _Tile, group: int, device) -> torch.Tensor:
    """(1, group * rows, keys) additive mask, the same for every key head: row r sees counts[r] keys (rows:
    TILE_ROWS in the tiled form, the tile's own in the keyed form)."""
    if tile.mask is not None:
        return tile.mask
    counts = torch.tensor(tile.counts, device=device)
    mask = torch.zeros(len(tile.counts), tile.keys, device=device).masked_fill_(
        torch.arange(tile.keys, device=device) >= counts[:, None], float("-inf"))
    return mask.repeat(group, 1)[None]


def _tile(first: int, lengths: list[int], keys: int, size: int | None = TILE_ROWS) -> _Tile:
    """Rows first.. seeing `lengths` keys, padded with rows that see one key to `size` rows (None: no padding)."""
    return _Tile(first, first + len(lengths), lengths + [1] * ((size or 0) - len(lengths)), keys)


def _gathered_mask(gathered: _Gathered, group: int, kv_heads: int, device) -> torch.Tensor:
    """Each row's tile mask, repeated for every key head (batch index: key head, then row)."""
    if gathered.mask is not None:
        return gathered.mask
    masks = torch.cat([_tile_mask(tile, group, device) for tile in gathered.tiles])  # (m, group * TILE_ROWS, keys)
    return masks.expand(kv_heads, *masks.shape).reshape(-1, *masks.shape[1:])


def _gather(attention_mask: torch.Tensor, rows: list[int], padded: int, past: int, size: int | None) -> _Gathered:
    """`rows` of the block with their keys' indices, `padded` per row, the padding at index `past` (a masked key)."""
    indices = [_seen(attention_mask, t) for t in rows]
    index = torch.full((len(rows), padded), past, dtype=torch.long, device=attention_mask.device)
    for i, seen in enumerate(indices):
        index[i, :seen.numel()] = seen
    return _Gathered(torch.tensor(rows, device=attention_mask.device), index.view(-1),
                     [_tile(0, [seen.numel()], padded, size) for seen in indices], padded)


def _layout(attention_mask: torch.Tensor | None, rows: int, keys: int, group: int, kv_heads: int,
            device, size: int | None = TILE_ROWS) -> _Layout:
    """size: rows per tile, short tiles padded to it (the tiled form); None: a tile holds every row of a run
    with one padded key count, unpadded (the keyed form)."""
    if attention_mask is None:  # causal
        lengths, prefix = [keys - rows + t + 1 for t in range(rows)], [True] * rows
    else:
        seen = attention_mask[0, 0]
        seen = seen if seen.dtype == torch.bool else seen == 0
        counts = seen.sum(-1)
        lengths = counts.tolist()
        prefix = (seen == (torch.arange(keys, device=device) < counts[:, None])).all(-1).tolist()
    tiles, by_keys, t = [], {}, 0
    while t < rows:
        if not prefix[t]:  # a tile of its own, its keys gathered, batched with the others of its key count
            by_keys.setdefault(_padded(lengths[t]), []).append(t)
            t += 1
            continue
        end, padded = t + 1, _padded(lengths[t])
        while end < rows and (size is None or end - t < size) and prefix[end] and _padded(lengths[end]) == padded:
            end += 1
        tiles.append(_tile(t, lengths[t:end], padded, size))
        t = end
    gathered = [_gather(attention_mask, nodes[i:i + GATHER_ROWS], padded, keys, size)
                for padded, nodes in by_keys.items() for i in range(0, len(nodes), GATHER_ROWS)]
    if len(tiles) + sum(len(g.tiles) for g in gathered) <= KEEP_MASKS:  # a prompt's prefill makes its masks
        for tile in tiles:  # at each call instead of holding them all
            tile.mask = _tile_mask(tile, group, device)
        for nodes in gathered:
            nodes.mask = _gathered_mask(nodes, group, kv_heads, device)
    widest = [tile.keys for tile in tiles] + [nodes.keys for nodes in gathered]
    return _Layout(tiles, gathered, max(widest))


_LAST: tuple | None = None  # (mask, shape, layout) of the latest pass: every layer of a pass shares it


def _layout_of(attention_mask: torch.Tensor | None, rows: int, keys: int, group: int, kv_heads: int,
               device, size: int | None = TILE_ROWS) -> _Layout:
    global _LAST
    shape = (rows, keys, group, kv_heads, str(device), size, KEY_BLOCK)
    last = _LAST
    if last is not None and last[0] is attention_mask and last[1] == shape:
        return last[2]
    layout = _layout(attention_mask, rows, keys, group, kv_heads, device, size)
    _LAST = (attention_mask, shape, layout)  # keeps the mask alive, so `is` cannot match a new one
    return layout


def _on_one_thread(attend):
    """`attend` with torch's thread count set to 1 while it runs (see the module's docstring)."""
    @functools.wraps(attend)
    def on_one_thread(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return attend(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return attend(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return on_one_thread


def _padded_float(x: torch.Tensor, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(1, Hkv, S, D) as `dtype` (Hkv, width, D), finite past S (masked for every row): a view of the cache's own
    room past S where it has it in `dtype` (kvcache.has_room), else a padded copy with zeros."""
    if x.dtype == dtype and has_room(x, width):
        return x[0].as_strided((x.shape[1], width, x.shape[3]), (x.stride(1), x.shape[3], 1))
    out = x.new_empty((x.shape[1], width, x.shape[3]), dtype=dtype)
    out[:, :x.shape[2]] = x[0]
    out[:, x.shape[2]:] = 0
    return out


@_on_one_thread
def tiled_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """The signature of `per_row_attention`. Every product has TILE_ROWS rows per query head and a multiple of
    KEY_BLOCK keys, in float32: scores, softmax and the weighted values as three batched calls per tile, or per
    group of gathered rows (a tile each)."""
    _check(query)
    softcap = kwargs.get("softcap")
    _, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    layout = _layout_of(attention_mask, rows, keys, group, kv_heads, query.device)
    # At least one key past the real ones (finite, masked): the gathered rows' padding points there.
    width = max(layout.keys, keys + 1 if layout.gathered else keys)
    key, value = _padded_float(key, width), _padded_float(value, width)
    out = query.new_empty((1, rows, heads, dim))
    for tile in layout.tiles:
        n, padded = tile.last - tile.first, tile.keys
        q = query.new_zeros((kv_heads, group, TILE_ROWS, dim), dtype=torch.float32)
        q[:, :, :n] = query[0, :, tile.first:tile.last].view(kv_heads, group, n, dim)
        o = _attend(q.view(kv_heads, group * TILE_ROWS, dim), key[:, :padded], value[:, :padded],
                    _tile_mask(tile, group, query.device), scaling, softcap).view(kv_heads, group, TILE_ROWS, dim)
        out[0, tile.first:tile.last].view(n, kv_heads, group, dim).copy_(o[:, :, :n].permute(2, 0, 1, 3))
    for nodes in layout.gathered:  # batch index: key head, then row, as _gathered_mask has it
        m, padded = nodes.rows.numel(), nodes.keys
        q = query.new_zeros((kv_heads, m, group, TILE_ROWS, dim), dtype=torch.float32)
        q[:, :, :, 0] = query[0].index_select(1, nodes.rows).view(kv_heads, group, m, dim).transpose(1, 2)
        k, v = (x.index_select(1, nodes.index).view(kv_heads * m, padded, dim) for x in (key, value))
        o = _attend(q.view(kv_heads * m, group * TILE_ROWS, dim), k, v,
                    _gathered_mask(nodes, group, kv_heads, query.device), scaling, softcap)
        o = o.view(kv_heads, m, group, TILE_ROWS, dim)[:, :, :, 0]
        out[0].index_copy_(0, nodes.rows, o.permute(1, 0, 2, 3).reshape(m, heads, dim).to(out.dtype))
    return out, None


@_on_one_thread
def keyed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """The signature of `per_row_attention`. In bfloat16, one call per run of rows with one padded key count
    (a multiple of KEY_BLOCK), with just those rows; gathered rows (a tree's runner-ups) as in the tiled form,
    one row each. Other dtypes, and soft-capped scores, take `tiled_attention`."""
    if query.dtype != torch.bfloat16 or kwargs.get("softcap"):
        return tiled_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    _check(query)
    _, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    layout = _layout_of(attention_mask, rows, keys, group, kv_heads, query.device, size=None)
    width = max(layout.keys, keys + 1 if layout.gathered else keys)
    key, value = (_padded_float(x, width, x.dtype) for x in (key, value))

    def attend(tile: _Tile) -> torch.Tensor:  # (n, kv_heads, group, dim), a view
        n, padded = tile.last - tile.first, tile.keys
        q = query[0, :, tile.first:tile.last].reshape(kv_heads, group * n, dim)
        # the scores' product reads its keys dense: over a view of the cache's room (heads a buffer apart)
        # oneDNN takes a slower path, with the same bits, that costs more than this copy; the values' product
        # gains too little to pay for one
        o = _attend_half(q, key[:, :padded].contiguous(), value[:, :padded], _tile_mask(tile, group, query.device),
                         scaling)
        return o.view(kv_heads, group, n, dim).permute(2, 0, 1, 3)

    if len(layout.tiles) == 1 and not layout.gathered:  # nothing to assemble: a view (one row: no copy at all)
        return attend(layout.tiles[0]).reshape(1, rows, heads, dim), None
    out = query.new_empty((1, rows, heads, dim))
    for tile in layout.tiles:
        out[0, tile.first:tile.last].view(tile.last - tile.first, kv_heads, group, dim).copy_(attend(tile))
    for nodes in layout.gathered:  # batch index: key head, then row, as _gathered_mask has it
        m, padded = nodes.rows.numel(), nodes.keys
        q = query[0].index_select(1, nodes.rows).view(kv_heads, group, m, dim).transpose(1, 2)
        k, v = (x.index_select(1, nodes.index).view(kv_heads * m, padded, dim) for x in (key, value))
        o = _attend_half(q.reshape(kv_heads * m, group, dim), k, v,
                         _gathered_mask(nodes, group, kv_heads, query.device), scaling)
        out[0].index_copy_(0, nodes.rows, o.view(kv_heads, m, group, dim).permute(1, 0, 2, 3).reshape(m, heads, dim))
    return out, None


def _attend_half(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """Batched (B, M, D) half-precision queries over (B, S, D) keys and values under a float32 additive mask
    broadcast to (B, M, S): products in q's dtype, the softmax in float32, as eager attention computes."""
    scores = torch.add(mask, torch.bmm(q, k.transpose(1, 2)), alpha=scaling)  # float32: the mask's dtype
    return torch.bmm(torch.softmax(scores, -1).to(q.dtype), v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
            softcap: float | None) -> torch.Tensor:
    """Batched (B, M, D) queries over (B, S, D) keys and values under an additive mask broadcast to (B, M, S)."""
    if softcap:  # capped before the mask is added, as transformers' eager attention does
        scores = _soft_capped(torch.bmm(q, k.transpose(1, 2)).mul_(scaling), softcap).add_(mask)
    else:
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scaling)
    return torch.bmm(torch.softmax(scores, -1), v)


def compiled_enabled() -> bool:
    """SDSAT_ATTENTION_KERNEL=0 keeps the compiled form out of tunings (it is offered where native.py builds)."""
    return os.environ.get("SDSAT_ATTENTION_KERNEL", "1") != "0"


def compiled_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """The signature of `per_row_attention`: every row of the pass in one call to the compiled kernel."""
    kernel = native.module()
    if kernel is None:  # set_precision builds it before choosing this form; another numerics would break identity
        raise RuntimeError("the compiled attention form needs the compiled kernels (sdsat/native.py)")
    _check(query)
    if (kwargs.get("softcap") or query.dtype not in (torch.float32, torch.bfloat16) or query.device.type != "cpu"
            or value.shape != key.shape or key.shape[3] != query.shape[3]
            or any(x.stride(3) != 1 for x in (query, key, value))
            or not kernel.applies(query.shape[1], key.shape[1], query.shape[3])):
        return per_row_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    counts, index = _rows_of(attention_mask, query.shape[2], key.shape[2])
    return kernel.attend(query, key, value, counts, index, scaling), None


_LAST_ROWS: tuple | None = None  # (mask, shape, counts, index) of the latest pass: every layer of a pass shares it
_NO_INDEX = torch.empty(0, dtype=torch.long)


def _rows_of(attention_mask: torch.Tensor | None, rows: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys each row sees, as the kernel takes them: counts (rows,), and each row's key indices (rows, widest)
    where some row's keys are not a prefix of the cache (a draft tree's node), else an empty index."""
    global _LAST_ROWS
    last = _LAST_ROWS
    if last is not None and last[0] is attention_mask and last[1] == (rows, keys):
        return last[2], last[3]
    if attention_mask is None:  # causal
        counts, index = torch.arange(keys - rows + 1, keys + 1), _NO_INDEX
    elif attention_mask.shape[-1] != keys:
        raise ValueError(f"the attention mask covers {attention_mask.shape[-1]} keys, the cache holds {keys}")
    else:
        seen = attention_mask[0, 0]
        seen = (seen if seen.dtype == torch.bool else seen == 0).cpu()
        counts = seen.sum(-1)
        if bool((seen == (torch.arange(keys) < counts[:, None])).all()):
            index = _NO_INDEX
        else:  # sorted: each row's seen keys first, in order
            order = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True)
            index = order[:, :int(counts.max())].contiguous()
    _LAST_ROWS = (attention_mask, (rows, keys), counts, index)  # keeps the mask alive, so `is` cannot match anew
    return counts, index


def register() -> tuple[str, str, str, str]:
    """Make the forms selectable as `model.set_attn_implementation(TILED, KEYED, PER_ROW or COMPILED)`."""
    for name, function in ((TILED, tiled_attention), (KEYED, keyed_attention), (PER_ROW, per_row_attention),
                           (COMPILED, compiled_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    return TILED, KEYED, PER_ROW, COMPILED
