"""Launch shapes of the Triton kernels: tile sizes, warps and software-pipeline stages.

Any shape gives the same result up to float rounding (the masks cover ragged edges); the shape decides
only speed. The defaults (per dtype for prefill) are the fastest of benchmarks/gpu_attention_check.py
--sweep on an H200 (benchmarks/RESULTS.md, "Triton kernels on an H200"); float16 takes bfloat16's, unswept."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per program (prefill only: decode's rows are its GQA group)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"


PREFILL_DEFAULTS = {
    torch.float32: LaunchConfig(64, 32, 4, 3),
    torch.bfloat16: LaunchConfig(64, 64, 4, 3),
    torch.float16: LaunchConfig(64, 64, 4, 3),
}
DECODE_DEFAULT = LaunchConfig(16, 64, 4, 2)  # the fastest shape in float32 and bfloat16 alike
# The shapes benchmarks/gpu_attention_check.py --sweep times against each other (decode's rows are fixed by
# its GQA group, so its shapes vary the rest only).
PREFILL_SWEEP = [
    LaunchConfig(m, n, w, s)
    for m, n, w, s in [
        (64, 64, 4, 3),
        (64, 32, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 8, 3),
        (128, 64, 4, 2),
        (128, 128, 8, 2),
    ]
]
DECODE_SWEEP = [
    LaunchConfig(16, n, w, s) for n, w, s in [(64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 8, 3), (128, 8, 2), (64, 4, 2)]
]
