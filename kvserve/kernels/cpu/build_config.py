"""What the CPU kernels are built from, and the fingerprint that says whether a build fits this machine.

Standard library only: setup.py loads this file by path (before kvserve is importable) to build the
kernels at install, and kvserve/kernels/cpu/__init__.py uses the same definitions at run time, so the
install build and the run-time build cannot drift apart.

The fingerprint hashes everything a build depends on: the sources and headers (every *.cpp and *.h of
this folder, so files added later are picked up), the compiler flags, the torch version the module links
against, and the CPU's feature flags (`-march=native` makes the code valid only on CPUs with the same
features). The install build writes it into the module's binary (build_fingerprint.cpp) and the loader
reads it back from the file before importing it: a module built for other sources or another CPU is
never imported.

Instruction-set paths (ISAS): the kernels choose their code at compile time (#ifdef __AMX_TILE__,
__AVX512F__, __AVX2__, ...), so each path is a build of its own: -march=native with the instructions above
the path switched off. A CPU can run every path whose `requires` flags it has, and each path's module has
its own name and fingerprint, so the builds of one machine never collide (isa.py chooses one at run time).
"""

from __future__ import annotations

import hashlib
import platform
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The run-time build's module name, and the install build's module (kvserve.kernels.cpu._prebuilt_<isa>),
# before the path's name is appended (module_name, prebuilt_name).
NAME = "kvserve_cpu_ops"
PREBUILT_NAME = "_prebuilt"
# -ffp-contract=off: no FMA contraction, so float32 results round like the torch ops they replace.
# -fno-trapping-math (as torch itself is built): without it GCC will not vectorize floor().
# -march=native: the build happens on the machine that runs it (the fingerprint checks that it does);
# each path (ISAS) then switches off what lies above it.
# Tuples: torch's JIT builder appends its own link flags to the list it is given, and the fingerprint reads
# these, so a list handed over would change every later fingerprint of the process (and the next load's hash).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)
# GCC's -mno-amx-tile leaves AMX-BF16 and AMX-INT8 on: each is switched off by name. -mno-avx512f switches
# off every AVX-512 subset (BW, VL, BF16, ...), -mno-avx2 AVX-512 too.
NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# 512-bit vectors where the path has them: GCC otherwise prefers 256 bits even with AVX-512.
WIDE_VECTORS = "-mprefer-vector-width=512"


@dataclass(frozen=True)
class Isa:
    """One instruction-set path: the /proc/cpuinfo flags a CPU needs to run its build, and the flags
    (after CFLAGS, x86 only) that keep the compiler below it."""

    name: str
    requires: tuple[str, ...]
    cflags: tuple[str, ...]


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl")
# In order, each above the one before. "generic" is the kernels' portable C++ loops (no intrinsics; the
# only path on other architectures), the others the intrinsics each #ifdef selects.
ISAS = (
    Isa("generic", (), ("-mno-avx2", "-mno-fma", "-mno-f16c", *NO_AMX)),
    Isa("avx2", _AVX2, ("-mno-avx512f", *NO_AMX)),
    Isa("avx512", _AVX512, (WIDE_VECTORS, *NO_AMX)),
    Isa("amx", (*_AVX512, "amx_tile", "amx_bf16"), (WIDE_VECTORS,)),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)
# The install build defines this macro as "fp_<fingerprint>"; build_fingerprint.cpp stores it after MARKER.
FINGERPRINT_MACRO = "KVSERVE_FINGERPRINT"
MARKER = b"kvserve-build-fingerprint:"
CPUINFO = Path("/proc/cpuinfo")


def sources(directory: Path = HERE) -> list[Path]:
    return sorted(directory.glob("*.cpp"))


def headers(directory: Path = HERE) -> list[Path]:
    return sorted(directory.glob("*.h"))


def cpu_features(cpuinfo: Path = CPUINFO) -> list[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (sorted), or [] where there is no such file."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return sorted(match.group(1).split()) if match else []


def isa_named(name: str) -> Isa:
    """The path called `name` (one of ISA_NAMES)."""
    for isa in ISAS:
        if isa.name == name:
            return isa
    raise KeyError(name)


def executable_isas(features: list[str] | None = None) -> list[Isa]:
    """The paths a CPU with these feature flags (default: this machine's) can run, lowest first."""
    have = set(cpu_features() if features is None else features)
    return [isa for isa in ISAS if have.issuperset(isa.requires)]


def cflags(isa: Isa, machine: str | None = None) -> list[str]:
    """The compiler flags of `isa`'s build; the x86 switches only on x86 (elsewhere only generic runs)."""
    x86 = (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686")
    return [*CFLAGS, *(isa.cflags if x86 else ())]


def module_name(isa: Isa) -> str:
    return f"{NAME}_{isa.name}"


def prebuilt_name(isa: Isa) -> str:
    return f"{PREBUILT_NAME}_{isa.name}"


def fingerprint(torch_version: str, isa: Isa, directory: Path = HERE, features: list[str] | None = None) -> str:
    """sha256 over sources, headers, the path and its flags, torch version and CPU features (hex, 64 characters)."""
    digest = hashlib.sha256()
    for path in sources(directory) + headers(directory):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    cpu = cpu_features() if features is None else features
    for part in [isa.name, "|", *cflags(isa), "|", *LDFLAGS, "|", torch_version, "|", *cpu]:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def fingerprint_define(value: str) -> str:
    """The compiler flag that embeds `value`: an identifier-like token, so no shell or ninja quoting is needed."""
    return f"-D{FINGERPRINT_MACRO}=fp_{value}"


def embedded_fingerprint(module_file: Path) -> str | None:
    """The fingerprint the install build wrote into `module_file`, or None (no marker, unreadable)."""
    try:
        data = module_file.read_bytes()
    except OSError:
        return None
    start = data.find(MARKER + b"fp_")
    if start < 0:
        return None
    start += len(MARKER) + 3
    value = data[start : start + 64]
    return value.decode() if re.fullmatch(rb"[0-9a-f]{64}", value) else None
