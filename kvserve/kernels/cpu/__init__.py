"""kvserve's own CPU kernels (one .cpp file per kernel, declared in ops.h).

Each kernel fuses a chain of small torch ops on the decode hot path; the pure-torch function it
replaces lives in kvserve/model/layer_ops.py (and kernels/attention_sdpa.py for attention), serves as
the fallback where the kernels cannot be built (no compiler, CUDA tensors), and is the reference
tests/test_cpu_ops.py compares it with.

`load()` picks, once per process, a build of the instruction-set path isa.py selects (the CPU's best, or
the one KVSERVE_CPU_ISA forces; an impossible value raises) (`choice()` says which and why; the startup
report prints it):
1. nothing when KVSERVE_CPU_KERNELS=0 (torch ops everywhere);
2. the path's module `pip install` built (setup.py, kvserve.kernels.cpu._prebuilt_<path>), if the
   fingerprint written into it matches this machine's (build_config.py: same sources, path, flags, torch
   and CPU features), so a fresh install starts without compiling; KVSERVE_CPU_KERNELS=jit skips it;
3. otherwise a build of the path with torch's JIT builder, cached under TORCH_EXTENSIONS_DIR (default
   ~/.cache/torch_extensions) so only the first process after a change pays it. It is logged before it
   starts and when it ends; processes build one at a time (an flock, released even when its holder is
   killed), and one that waits for another's build says so;
4. nothing, with the reason logged, where neither works.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.kernels.cpu.build_config import Isa

logger = logging.getLogger(__name__)

SOURCES = [str(path) for path in build_config.sources()]
# The size of a whole build in core-minutes, for the estimate the log gives before one starts.
BUILD_CORE_MINUTES = 10


@dataclass(frozen=True)
class KernelChoice:
    module: ModuleType | None
    isa: cpu_isa.IsaChoice  # the instruction-set path the module was built for
    source: str  # "install build", "run-time build", "off" or "unavailable"
    reason: str


def build_directory(isa: Isa) -> Path:
    """TORCH_EXTENSIONS_DIR (or torch's default root), one folder per path and Python version."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"{build_config.module_name(isa)}_py{sys.version_info.major}{sys.version_info.minor}"


def remove_orphaned_lock(directory: Path) -> bool:
    """Remove torch's build lock in `directory`; True when there was one. Call only holding the directory's
    kvserve-build.lock: every kvserve build takes that flock first, and the kernel releases it when its holder
    dies, so a torch lock found under it was left by a build killed midway (a server stopped during its first
    start), and torch would wait on it forever."""
    lock = directory / "lock"
    if not lock.exists():
        return False
    logger.warning("removing %s, left by a build that did not finish", lock)
    lock.unlink(missing_ok=True)
    return True


def current_fingerprint(isa: Isa) -> str:
    import torch

    return build_config.fingerprint(torch.__version__, isa)


def prebuilt_mismatch(isa: Isa, fingerprint: str) -> str | None:
    """None when the install build of `isa` exists and fits `fingerprint`, else why it cannot be used."""
    spec = importlib.util.find_spec(f"{__name__}.{build_config.prebuilt_name(isa)}")
    if spec is None or spec.origin is None:
        return "no install build (installed without building the kernels, or run from a source tree)"
    embedded = build_config.embedded_fingerprint(Path(spec.origin))
    if embedded != fingerprint:
        return "the install build does not fit this machine (sources, flags, torch or CPU features changed)"
    return None


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path`, logging when another process holds it first."""
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another process is building the CPU kernels (%s holds the lock): waiting for it", lock_path)
            started = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            logger.warning("waited %.0f s for the other process's CPU kernel build", time.monotonic() - started)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_for_this_cpu(isa: Isa, fingerprint: str, why: str) -> ModuleType:
    """The run-time build of `isa` (or its cache), logged before and after whenever it compiles."""
    from torch.utils.cpp_extension import load as jit_load

    name = build_config.module_name(isa)
    directory = build_directory(isa)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = directory / "kvserve-fingerprint"
    with exclusive(directory / "kvserve-build.lock"):
        remove_orphaned_lock(directory)
        cached = (directory / f"{name}.so").exists() and stamp.exists() and stamp.read_text() == fingerprint
        if not cached:
            minutes = max(1, round(BUILD_CORE_MINUTES / (os.cpu_count() or 1)))
            logger.warning(
                "building CPU kernels for this CPU (%s path; first start only, ~%d min): %s", isa.name, minutes, why
            )
        started = time.monotonic()
        module = jit_load(
            name=name,
            build_directory=str(directory),
            sources=SOURCES,
            extra_cflags=build_config.cflags(isa),
            extra_ldflags=list(build_config.LDFLAGS),  # a copy: torch appends to it
            verbose=False,
        )
        if not cached:
            logger.warning("built the CPU kernels in %.0f s (cached in %s)", time.monotonic() - started, directory)
            stamp.write_text(fingerprint)
    return module


@functools.cache
def choice() -> KernelChoice:
    """Which kernels this process uses, and why (see the module docstring for the order). Raises
    cpu_isa.IsaError where KVSERVE_CPU_ISA names a path this CPU cannot execute (outside the fallback below:
    a forced path is never replaced by torch ops in silence)."""
    chosen = cpu_isa.selected()
    setting = os.environ.get("KVSERVE_CPU_KERNELS", "1")
    if setting == "0":
        return KernelChoice(None, chosen, "off", "KVSERVE_CPU_KERNELS=0")
    try:
        fingerprint = current_fingerprint(chosen.isa)
        why = "KVSERVE_CPU_KERNELS=jit" if setting == "jit" else prebuilt_mismatch(chosen.isa, fingerprint)
        if why is None:
            module = importlib.import_module(f"{__name__}.{build_config.prebuilt_name(chosen.isa)}")
            return KernelChoice(module, chosen, "install build", "its fingerprint matches this machine")
        return KernelChoice(build_for_this_cpu(chosen.isa, fingerprint, why), chosen, "run-time build", why)
    except Exception as exc:  # no compiler, no ninja, a header mismatch: fall back to torch ops
        logger.warning("kvserve CPU kernels unavailable, using torch ops instead: %s", exc)
        return KernelChoice(None, chosen, "unavailable", str(exc))


def load() -> ModuleType | None:
    """The compiled kernels, or None (with the reason logged once) where they are off or cannot be built."""
    return choice().module
