"""Long-lived CPU tensors that every decode step streams (the projection weights, their AMX tiles, the
KV cache) on 2 MiB transparent huge pages.

Why: a decode step reads all 270 MB of SmolLM2-135M's bf16 weights and, batched, hundreds of MB of K/V.
With 4 KiB pages every 4 KiB is another TLB entry, and in a VM a TLB miss walks two sets of page tables;
the kernels then wait on page walks rather than on the memory bus: batch-1 decode's GEMVs and
linear_amx both run measurably faster from one buffer on huge pages
(figures: benchmarks/RESULTS.md, "Figures behind the code's rules").

How: Linux backs a range advised with madvise(MADV_HUGEPAGE) by huge pages as it is first touched, when
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise" (this machine: "madvise"); with
"never", or off Linux, the advice does nothing and the buffers are ordinary memory. So a buffer is
mapped fresh with 2 MiB of slack, advised from its first 2 MiB boundary, and only then written.
PyTorch's own switch (THP_MEM_ALLOC_ENABLE=1) advises only allocations of 2 MiB or more, and most of
this model's projections are smaller (o_proj 0.66 MB, qkv 1.1 MB, down 1.8 MB): hence one buffer for all
of them, in the order a decode step reads them.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable

import torch

from kvserve.engine.host_memory import return_freed_memory
from kvserve.intmath import div_ceil

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20
# Each tensor in a shared buffer starts on a cache line, as the kernels' 64-byte vector and tile loads expect.
ALIGN_BYTES = 64
# While moving, the originals' freed pages go back to the kernel every this many bytes: the process would
# otherwise hold every weight twice at the end of loading (the heap keeps what it frees: host_memory.py).
RETURN_EVERY_BYTES = 16 * 2**20


def empty_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat, uninitialized CPU tensor of `numel` elements in fresh memory of its own (an anonymous private
    mapping, not the heap, whose freed blocks may already sit on small pages), its whole 2 MiB pages
    advised huge before anything touched them. The tensor keeps the mapping alive."""
    elem = torch.empty((), dtype=dtype).element_size()
    length = numel * elem
    mapping = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES  # a multiple of the small page size, as madvise needs
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None and length >= HUGE_PAGE_BYTES:
        try:
            mapping.madvise(advice, start, length // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
        except OSError as exc:  # EINVAL: a kernel built without THP; ordinary pages then
            logger.info("madvise(MADV_HUGEPAGE) refused (%s); using ordinary pages", exc)
    return whole[start : start + length].view(dtype)


def move_into_one_buffer(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Copy contiguous CPU tensors of one dtype into one huge-page buffer, in the order given, and repoint
    each tensor at its copy (Tensor.set_), so that every holder of it reads the buffer from now on; a
    tensor listed twice (tied embeddings) is moved once. Returns the buffer, None when given nothing."""
    distinct = list({id(t): t for t in tensors}.values())
    if not distinct:
        return None
    dtype = distinct[0].dtype
    if any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in distinct):
        raise ValueError("move_into_one_buffer takes contiguous CPU tensors of one dtype")
    align = ALIGN_BYTES // distinct[0].element_size()
    offsets, total = [], 0
    for t in distinct:
        offsets.append(total)
        total += div_ceil(t.numel(), align) * align
    buffer = empty_on_huge_pages(total, dtype)
    moved = 0
    for t, offset in zip(distinct, offsets, strict=True):
        copy = buffer[offset : offset + t.numel()].view(t.shape)
        copy.copy_(t)
        with torch.no_grad():
            t.set_(buffer.untyped_storage(), buffer.storage_offset() + offset, t.shape, copy.stride())
        moved += t.nbytes
        if moved >= RETURN_EVERY_BYTES:  # the originals' pages, freed by set_, back to the kernel as we go
            return_freed_memory()
            moved = 0
    return buffer
