"""A CPU model's weights in one block of memory, in the order a pass reads them, on huge pages where granted.

A decoding pass on a CPU streams every weight from memory once, so how the weights lie in memory sets much of a
pass's time: as separate allocations they sit on 4 KB pages wherever the allocator put them, each page a TLB entry
and a stop for the hardware's prefetcher. Copied into one anonymous mapping that asks the kernel for transparent
huge pages (Linux's madvise; where the kernel grants none the block is still one piece, in order), the products of
a pass run faster for every row count (figures: docs/architecture.md, "Weights in one block"). Parameters become
views into the block; a parameter shared by two modules (tied embeddings) is copied once and stays shared.
Converting the model again (another dtype or device) gives its weights separate storage again.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: each weight starts on a cache line
_HUGE_PAGE = 2 << 20
_BLOCK = "_sdsat_weight_block"  # the attribute a gathered model keeps its block in


def gather(model: nn.Module) -> bool:
    """Copy `model`'s parameters into one block and make them views of it; True where done. A model with a parameter
    off the CPU is left as it is."""
    params = list(model.parameters())
    if gathered(model):
        return True
    model.__dict__.pop(_BLOCK, None)  # an earlier block, which a conversion since has left
    if not params or any(p.device.type != "cpu" for p in params):
        return False
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    try:
        block = mmap.mmap(-1, -(-size // _HUGE_PAGE) * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError) as err:  # no anonymous private mappings here (Windows)
        log.info("model weights stay where they are: %s", err)
        return False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)  # before the pages are touched, so they come as huge pages
        except OSError:
            pass
    memory = torch.frombuffer(block, dtype=torch.uint8)  # keeps `block` alive while any view of it lives
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            nbytes = p.numel() * p.element_size()
            view = memory[offset:offset + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view  # the old storage is freed here, one weight at a time
    model.__dict__[_BLOCK] = memory
    return True


def gathered(model: nn.Module) -> bool:
    """Whether every parameter of `model` is a view of the block `gather` made."""
    memory = model.__dict__.get(_BLOCK)
    if memory is None:
        return False
    start, end = memory.data_ptr(), memory.data_ptr() + memory.numel()
    return all(start <= p.data_ptr() < end for p in model.parameters())
