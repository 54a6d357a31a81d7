"""Builds kvserve's CPU kernels (kvserve/kernels/cpu/*.cpp) at install time; everything else is in pyproject.toml.

The kernels link against the torch that is installed, so the package is built without build isolation
(`pip install --no-build-isolation`, as scripts/setup.sh does): an isolated build would download a torch
of its own (a multi-GB CUDA build), which is why torch is not in [build-system] requires. The build
config and fingerprint come from kvserve/kernels/cpu/build_config.py, shared with the run-time build.
One module is built per instruction-set path this CPU can execute (build_config.ISAS: on an AMX machine
generic, avx2, avx512 and amx), so KVSERVE_CPU_ISA can force any of them at run time without compiling.
KVSERVE_BUILD_CPU_KERNELS=0 installs without them (the first server start then builds them, or
KVSERVE_CPU_KERNELS=0 runs on torch ops); KVSERVE_BUILD_CPU_KERNELS=avx2,amx (say) builds only those paths.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def load_build_config() -> ModuleType:
    name = "kvserve_build_config"
    spec = importlib.util.spec_from_file_location(name, ROOT / "kvserve/kernels/cpu/build_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there while the file runs
    spec.loader.exec_module(module)
    return module


def build_command() -> type:
    """torch's BuildExtension, each module compiled in a folder of its own: the paths' modules share their
    sources, and in one folder each would overwrite the other's object files and ninja file."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildEachInItsOwnFolder(BuildExtension):
        build_temp: str  # set by setuptools' finalize_options

        def build_extension(self, ext: Extension) -> None:
            shared = self.build_temp
            self.build_temp = os.path.join(shared, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared

    return BuildEachInItsOwnFolder


def paths_to_build(config: ModuleType, setting: str) -> list:
    """Every path this CPU executes for "1", else the comma-separated paths named (each one it executes)."""
    executable = config.executable_isas()
    if setting == "1":
        return executable
    names = setting.split(",")
    unknown = [name for name in names if name not in [isa.name for isa in executable]]
    if unknown:
        raise SystemExit(
            f"KVSERVE_BUILD_CPU_KERNELS={setting}: {', '.join(unknown)} is not a path this CPU executes; "
            f"use 0, 1 (all) or some of {', '.join(isa.name for isa in executable)}"
        )
    return [isa for isa in executable if isa.name in names]


def kernel_build() -> dict:
    if os.environ.get("KVSERVE_BUILD_CPU_KERNELS", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError as exc:
        raise SystemExit(
            f"kvserve builds its CPU kernels against the installed torch, and none is importable ({exc}): "
            "install torch first, then `pip install --no-build-isolation .` (see scripts/setup.sh), "
            "or set KVSERVE_BUILD_CPU_KERNELS=0 to install without the kernels"
        ) from exc
    config = load_build_config()
    sources = [str(path.relative_to(ROOT)) for path in config.sources()]
    extensions = [
        CppExtension(
            name=f"kvserve.kernels.cpu.{config.prebuilt_name(isa)}",
            sources=sources,
            # -g0: Python's own build flags (sysconfig) ask for debug info, which only slows the compile.
            extra_compile_args={
                "cxx": [
                    *config.cflags(isa),
                    "-g0",
                    config.fingerprint_define(config.fingerprint(torch.__version__, isa)),
                ]
            },
            extra_link_args=list(config.LDFLAGS),
        )
        for isa in paths_to_build(config, os.environ.get("KVSERVE_BUILD_CPU_KERNELS", "1"))
    ]
    return {"ext_modules": extensions, "cmdclass": {"build_ext": build_command()}}


setup(**kernel_build())
