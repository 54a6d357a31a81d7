"""Which instruction-set path this process's CPU kernels run: the best one this CPU can execute, or the
one KVSERVE_CPU_ISA forces, so the paths below a CPU's best are measured and tested on it too.

The paths (build_config.ISAS, lowest first): generic (the kernels' portable C++ loops), avx2, avx512,
amx. Forcing one means loading that path's build (its own module and fingerprint) and deciding every
CPU-feature question as a CPU without the instructions above it would (`IsaChoice.bf16`: the dtype
choice; `cap_torch`: torch's own CPU code, where the CLI starts the process). An unknown value, or a
path this CPU cannot execute, is an error naming the variable: never ignored, never silently replaced by
another path.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu.build_config import Isa

ENV = "KVSERVE_CPU_ISA"
# The variables that hold torch's own CPU code (ATen's vectorized kernels, oneDNN's products) to each path.
# torch reads them once per process, at first use: cap_torch must run before torch computes anything.
TORCH_CAPS = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}


class IsaError(ValueError):
    """KVSERVE_CPU_ISA names no path, or one this CPU cannot execute."""


@dataclass(frozen=True)
class IsaChoice:
    isa: Isa  # the path the kernels run
    best: Isa  # the best path this CPU can execute
    forced: bool  # chosen by KVSERVE_CPU_ISA (even where it names the best path)
    bf16: bool  # the path has native bf16 dot products (AMX, or AVX-512 on a CPU with AVX512-BF16)

    def describe(self) -> str:
        """E.g. "avx2 (forced by KVSERVE_CPU_ISA; this CPU runs up to amx)"."""
        name = self.isa.name + (" with AVX512-BF16" if self.isa.name == "avx512" and self.bf16 else "")
        if self.forced:
            return f"{name} (forced by {ENV}; this CPU runs up to {self.best.name})"
        return f"{name} (this CPU's best)"


def choose(setting: str | None, features: list[str]) -> IsaChoice:
    """The path for `setting` (the variable's value; None or "" for the CPU's best) on a CPU with
    `features` (its /proc/cpuinfo flags). Raises IsaError naming the variable for a value it cannot honour."""
    executable = build_config.executable_isas(features)
    best = executable[-1]  # generic has no requirements: every CPU executes it
    runnable = ", ".join(isa.name for isa in executable)
    if not setting:
        isa = best
    elif setting not in build_config.ISA_NAMES:
        raise IsaError(
            f"{ENV}={setting!r} is not a CPU kernel path: use one of {', '.join(build_config.ISA_NAMES)} "
            f"(this CPU runs {runnable})"
        )
    else:
        isa = build_config.isa_named(setting)
        if isa not in executable:
            missing = ", ".join(flag for flag in isa.requires if flag not in features)
            raise IsaError(
                f"{ENV}={setting}: this CPU cannot execute the {setting} path (it lacks {missing}); it runs {runnable}"
            )
    bf16 = isa.name == "amx" or (isa.name == "avx512" and "avx512_bf16" in features)
    return IsaChoice(isa, best, forced=bool(setting), bf16=bf16)


def selected() -> IsaChoice:
    """This process's path: KVSERVE_CPU_ISA, checked against this machine's CPU, else its best."""
    return choose(os.environ.get(ENV), build_config.cpu_features())


def cap_torch(choice: IsaChoice, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """For a forced path, set its TORCH_CAPS in `environ`, keeping any the user set; returns those it set.
    The CLI calls it first thing, so a forced path measures torch's operations as that CPU would run them."""
    if not choice.forced:
        return {}
    added = {name: value for name, value in TORCH_CAPS[choice.isa.name].items() if name not in environ}
    environ.update(added)
    return added
