"""Integer helpers shared by the scheduler, the kernels and the loaders."""

from __future__ import annotations


def div_ceil(numerator: int, denominator: int) -> int:
    """numerator / denominator rounded up, in integers (no float rounding for large values)."""
    return -(-numerator // denominator)
