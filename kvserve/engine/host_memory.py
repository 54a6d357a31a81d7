"""Keep freed host memory in the process instead of handing it back to the kernel after every step.

glibc's malloc gives a block above its mmap threshold (128 KiB at first, then the size of the largest
mmap'd block freed so far) fresh pages from mmap() and unmaps them on free; it also returns the top of
the heap once more than the trim threshold of it is free. A prefill step's activations are tens of MB a
layer, so on a fresh engine they kept arriving as new pages, tens of thousands of minor page faults a
step, and prefill steps ran markedly slower until the thresholds had drifted up; served, that fell on
the first run a fresh `kvserve serve` took. With both thresholds fixed, steps run at full speed from the
first one, with no faults after it. Figures: benchmarks/RESULTS.md, "Figures behind the code's rules".

The price is that the process keeps its peak heap, as a server that sizes its memory up front expects.
Loading is the exception: it frees copies of the weights (float32 from the checkpoint, the copies moved onto
huge pages) that no step will reuse, so the engine hands those pages back once, after loading.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# mallopt() parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap and are reused; 32 MiB is the most glibc accepts on 64-bit
# (HEAP_MAX_SIZE / 2). A 2,048-row prefill's largest activation is 2,048 x 3,072 x 2 B = 12.6 MB.
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30  # free heap top kept before any is returned
# Set by the user, these win: glibc reads them at start-up and we leave its settings alone.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _glibc_function(name: str) -> Callable[..., int] | None:
    """glibc's function `name`, or None off Linux or where the C library is not glibc (musl and others)."""
    if sys.platform != "linux":
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where nothing was changed (not
    glibc, or the user set them)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None or any(name in os.environ for name in USER_SETTINGS):
        return False
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not done:
        logger.warning("mallopt refused the mmap/trim thresholds; host memory is returned after every step")
    return done


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel now (glibc's malloc_trim); False where there is no glibc."""
    malloc_trim = _glibc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (glibc >= 2.33): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def free_heap_bytes() -> int | None:
    """Bytes malloc holds free in all its arenas (mallinfo2's fordblks), or None without glibc >= 2.33."""
    mallinfo2 = _glibc_function("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2  # type: ignore[attr-defined]
    info: Any = mallinfo2()
    return int(info.fordblks)


def return_freed_memory_beyond(retained_bytes: int) -> bool:
    """Hand freed heap back to the kernel when malloc holds more than retained_bytes of it; True if it did.

    keep_freed_memory keeps what a step frees for the next step; a rare outlier (a huge request body, its
    tokenization) would otherwise leave the process at its peak for good. Where the free total cannot be
    read, the heap is trimmed."""
    free = free_heap_bytes()
    if free is not None and free <= retained_bytes:
        return False
    return return_freed_memory()
