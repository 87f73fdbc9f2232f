"""A CPU model's weights in one block of memory, in the order the model registers them, on huge pages where granted.

A decoding pass on a CPU streams every weight from memory once, so how the weights lie in memory sets much of a
pass's time: as separate allocations they sit on 4 KB pages wherever the allocator put them, each page a TLB entry
and a stop for the hardware's prefetcher. Copied into one anonymous mapping that asks the kernel for transparent
huge pages (Linux's madvise; where the kernel grants none the block is still one piece, in order), the products of
a pass run faster for every row count (figures: docs/architecture.md, "Weights in one block"). Parameters become
views into the block, which they keep alive; a parameter shared by two modules (tied embeddings) is copied once and
stays shared. Converting the model again (another dtype or device), or putting its earlier tensors back, gives its
weights separate storage again and frees the block.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: each weight starts on a cache line
_HUGE_PAGE = 2 << 20
# Above this many bytes of weights the model is left as it is: while the copy is made, and while a tuning holds a
# model's earlier tensors to put them back, both copies are in memory (cpu_kernels.COPY_LIMIT_BYTES's reasoning).
LIMIT_BYTES = 2 << 30


def gather(model: nn.Module) -> bool:
    """Copy `model`'s parameters into one block and make them views of it; True where they are in one block now.
    A model with a parameter off the CPU, or over LIMIT_BYTES of weights, is left as it is."""
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" for p in params):
        return False
    if gathered(model):
        return True
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    if size > LIMIT_BYTES:
        return False
    try:  # a huge page more than needed, so the block can start on a huge page's boundary
        block = mmap.mmap(-1, -(-size // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE,
                          flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError) as err:  # no anonymous private mappings here (Windows)
        log.info("model weights stay where they are: %s", err)
        return False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)  # before the pages are touched, so they come as huge pages
        except OSError:
            pass
    memory = torch.frombuffer(block, dtype=torch.uint8)  # each view keeps `block` alive
    start = -memory.data_ptr() % _HUGE_PAGE
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            nbytes = p.numel() * p.element_size()
            view = memory[start + offset:start + offset + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view  # the old storage is freed here, unless something else holds it
    return True


def gathered(model: nn.Module) -> bool:
    """Whether every parameter of `model` lies in one block of memory (one storage)."""
    return len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
