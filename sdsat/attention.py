"""Row-invariant attention: each query row attends over exactly the keys it may see, one row at a time.

Greedy SDSAT reproduces vanilla decoding only if a token's logits come out the same whether it is
computed alone (vanilla) or as one row of a verify block. Batched attention breaks that: a block's
row also "sees" the keys masked out for it, so its softmax sum and its product with the values run
over a longer axis than the same row alone, and the kernels reduce a longer axis in another order.
Here every row's keys are cut to the ones it sees, in cache order, so row t of a block performs the
very operations the lone token does. The cost is one small attention call per row and layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

NAME = "sdsat_row_invariant"


def row_invariant_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: query (B, H, T, D), key/value (B, Hkv, S, D), a boolean (True: seen) or
    additive mask (B, 1, T, S) or None (causal); returns (B, T, H, D) and no weights. One sequence per batch."""
    if query.shape[0] != 1:
        raise ValueError("row-invariant attention decodes one sequence at a time")
    dtype = query.dtype
    rows, keys = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if query.dtype != torch.float32:  # CPUs without half-precision attention kernels take a slow path
        query, key, value = query.float(), key.float(), value.float()
    outs = []
    for t in range(rows):
        if attention_mask is None:  # causal: the keys up to this row's own
            k, v = key[:, :, :keys - rows + t + 1], value[:, :, :keys - rows + t + 1]
        else:
            row = attention_mask[0, 0, t]
            seen = (row if row.dtype == torch.bool else row == 0).nonzero().squeeze(-1)
            if int(seen[-1]) + 1 == seen.numel():  # a prefix of the keys: a view, no copy
                k, v = key[:, :, :seen.numel()], value[:, :, :seen.numel()]
            else:  # a draft tree's node: the cache, then its ancestors
                k, v = key.index_select(2, seen), value.index_select(2, seen)
        outs.append(F.scaled_dot_product_attention(query[:, :, t:t + 1], k, v, scale=scaling, enable_gqa=gqa))
    out = outs[0] if rows == 1 else torch.cat(outs, dim=2)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make the attention selectable as `model.set_attn_implementation(NAME)`; returns NAME."""
    AttentionInterface.register(NAME, row_invariant_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
