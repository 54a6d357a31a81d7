"""kvserve's own CPU kernels (one .cpp file per kernel, declared in ops.h), compiled on first use
with torch's C++ extension builder.

Each kernel fuses a chain of small torch ops on the decode hot path; the pure-torch function it
replaces lives in kvserve/model/layer_ops.py (and kernels/attention_sdpa.py for attention), serves as
the fallback where the extension cannot be built (no compiler, CUDA tensors), and is the reference
tests/test_cpu_ops.py compares it with.

The build is cached by torch under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), keyed by
the source and flags, so only the first process after a change pays the compile (~1-4 minutes on 2
cores). A build killed midway leaves torch's lock file behind, and torch would make every later
process wait on it forever without a word; `load` removes a lock older than any real build.
`-march=native` is right because the build happens on the machine that runs it.
`KVSERVE_CPU_KERNELS=0` turns the kernels off (torch ops everywhere).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
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


NAME = "kvserve_cpu_ops"
# A whole build takes ~4 minutes on 2 cores; a lock file older than this belongs to no live build.
STALE_LOCK_S = 20 * 60


def build_directory() -> Path:
    """TORCH_EXTENSIONS_DIR (or torch's default root), one folder per Python version."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"{NAME}_py{sys.version_info.major}{sys.version_info.minor}"


def remove_stale_lock(directory: Path) -> bool:
    """Remove the build lock in `directory` if it is older than STALE_LOCK_S; True when it did."""
    lock = directory / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_s < STALE_LOCK_S:
        return False  # another process may be building right now: torch waits for it
    logger.warning("removing %s, left %.0f minutes ago by a build that did not finish", lock, age_s / 60)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot be built."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_lock(directory)
        return build(
            name=NAME,
            build_directory=str(directory),
            sources=SOURCES,
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a header mismatch: fall back to torch ops
        logger.warning("kvserve CPU kernels unavailable, using torch ops instead: %s", exc)
        return None
