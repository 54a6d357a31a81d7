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
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The run-time build's module name, and the install build's module (kvserve.kernels.cpu._prebuilt).
NAME = "kvserve_cpu_ops"
PREBUILT_NAME = "_prebuilt"
# -ffp-contract=off: no FMA contraction, so float32 results round like the torch ops they replace.
# -fno-trapping-math (as torch itself is built): without it GCC will not vectorize floor().
# -march=native: the build happens on the machine that runs it (the fingerprint checks that it does).
CFLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp",
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
]  # fmt: skip
LDFLAGS = ["-fopenmp"]
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


def fingerprint(torch_version: str, directory: Path = HERE, features: list[str] | None = None) -> str:
    """sha256 over sources, headers, flags, torch version and CPU features (hex, 64 characters)."""
    digest = hashlib.sha256()
    for path in sources(directory) + headers(directory):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in [*CFLAGS, "|", *LDFLAGS, "|", torch_version, "|", *(cpu_features() if features is None else features)]:
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
