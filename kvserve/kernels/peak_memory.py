"""Peak memory of a call on the CPU, where torch has no allocator statistics (torch.cuda.max_memory_*
is CUDA-only and tracemalloc does not see torch's allocations).

The profiler with profile_memory=True records every allocation and free as a signed "[memory]" event;
replaying them in time order gives the high-water mark above what was live when the call started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_extra_memory(fn: Callable[[], T]) -> tuple[T, int]:
    """Run fn once; return its result and the peak bytes allocated during the call beyond the start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # kineto_results is the profiler's raw event list; FunctionEvent views fold allocations into ops.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak
