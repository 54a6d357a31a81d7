"""kvserve's own CPU kernels (one .cpp file per kernel, declared in ops.h), compiled on first use
with torch's C++ extension builder.

Each kernel fuses a chain of small torch ops on the decode hot path; the pure-torch function it
replaces lives in kvserve/model/layer_ops.py (and kernels/attention_sdpa.py for attention), serves as
the fallback where the extension cannot be built (no compiler, CUDA tensors), and is the reference
tests/test_cpu_ops.py compares it with.

The build is cached by torch under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), keyed by
the source and flags, so only the first process after a change pays the ~1 minute compile.
`-march=native` is right because the build happens on the machine that runs it.
`KVSERVE_CPU_KERNELS=0` turns the kernels off (torch ops everywhere).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCES = sorted(str(path) for path in Path(__file__).parent.glob("*.cpp"))
# -ffp-contract=off: no FMA contraction, so float32 results round like the torch ops they replace.
# -fno-trapping-math (as torch itself is built): without it GCC will not vectorize floor().
CFLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp",
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
]  # fmt: skip


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot be built."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name="kvserve_cpu_ops",
            sources=SOURCES,
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a header mismatch: fall back to torch ops
        logger.warning("kvserve CPU kernels unavailable, using torch ops instead: %s", exc)
        return None
