"""Wall-clock samples of one call, for the in-process timings of benchmarks and of the load-time probes."""

from __future__ import annotations

import time
from collections.abc import Callable


def call_times_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls of `fn`, after one untimed call (it warms caches, and lets
    oneDNN create its primitives)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times
