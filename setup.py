"""Builds kvserve's CPU kernels (kvserve/kernels/cpu/*.cpp) at install time; everything else is in pyproject.toml.

The kernels link against the torch that is installed, so the package is built without build isolation
(`pip install --no-build-isolation`, as scripts/setup.sh does): an isolated build would download a torch
of its own (a multi-GB CUDA build), which is why torch is not in [build-system] requires. The build
config and fingerprint come from kvserve/kernels/cpu/build_config.py, shared with the run-time build.
KVSERVE_BUILD_CPU_KERNELS=0 installs without them (the first server start then builds them, or
KVSERVE_CPU_KERNELS=0 runs on torch ops).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def load_build_config() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_config", ROOT / "kvserve/kernels/cpu/build_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_build() -> dict:
    if os.environ.get("KVSERVE_BUILD_CPU_KERNELS", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        raise SystemExit(
            f"kvserve builds its CPU kernels against the installed torch, and none is importable ({exc}): "
            "install torch first, then `pip install --no-build-isolation .` (see scripts/setup.sh), "
            "or set KVSERVE_BUILD_CPU_KERNELS=0 to install without the kernels"
        ) from exc
    config = load_build_config()
    fingerprint = config.fingerprint(torch.__version__)
    extension = CppExtension(
        name=f"kvserve.kernels.cpu.{config.PREBUILT_NAME}",
        sources=[str(path.relative_to(ROOT)) for path in config.sources()],
        # -g0: Python's own build flags (sysconfig) ask for debug info, which only slows the compile.
        extra_compile_args={"cxx": [*config.CFLAGS, "-g0", config.fingerprint_define(fingerprint)]},
        extra_link_args=config.LDFLAGS,
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**kernel_build())
