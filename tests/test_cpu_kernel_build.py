"""Choosing between the install build and a run-time build of the CPU kernels (kvserve/kernels/cpu):
the fingerprint, the marker the install build embeds, and what the loader logs. No full build here: the
compile is checked on one small file, the JIT builder is replaced by a stand-in."""

from __future__ import annotations

import importlib.util
import logging
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa

FEATURES = ["avx2", "f16c", "fma", "sse4_2"]
AVX2 = build_config.isa_named("avx2")


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A copy of the kernel folder's sources and headers, safe to edit."""
    for path in build_config.sources() + build_config.headers():
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def fingerprint(
    directory: Path, torch_version: str = "2.13.0", features: list[str] = FEATURES, isa: build_config.Isa = AVX2
) -> str:
    return build_config.fingerprint(torch_version, isa, directory, features)


def test_fingerprint_is_stable_and_changes_with_every_input(sources: Path) -> None:
    base = fingerprint(sources)
    assert base == fingerprint(sources) and len(base) == 64
    assert fingerprint(sources, torch_version="2.14.0") != base
    assert fingerprint(sources, features=[*FEATURES, "avx512f"]) != base  # another CPU
    assert fingerprint(sources, isa=build_config.isa_named("generic")) != base  # another path on the same CPU
    (sources / "gemv.cpp").write_text((sources / "gemv.cpp").read_text() + "\n// edited\n")
    edited = fingerprint(sources)
    assert edited != base
    (sources / "new_kernel.cpp").write_text("// a kernel added later\n")  # picked up by the glob
    assert fingerprint(sources) != edited
    assert (sources / "new_kernel.cpp") in build_config.sources(sources)
    (sources / "extra.h").write_text("#pragma once\n")
    assert sources / "extra.h" in build_config.headers(sources)


def test_cpu_features_come_from_the_first_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: sse avx2 fma\n\nprocessor\t: 1\nflags\t\t: sse\n")
    assert build_config.cpu_features(cpuinfo) == ["avx2", "fma", "sse"]
    assert build_config.cpu_features(tmp_path / "missing") == []


def test_embedded_fingerprint_reads_only_a_well_formed_marker(tmp_path: Path) -> None:
    value = "ab" * 32
    module = tmp_path / "module.so"
    module.write_bytes(b"\x7fELF..." + build_config.MARKER + f"fp_{value}".encode() + b"\0rest")
    assert build_config.embedded_fingerprint(module) == value
    module.write_bytes(b"\x7fELF..." + build_config.MARKER + b"fp_not-hex\0")
    assert build_config.embedded_fingerprint(module) is None
    module.write_bytes(b"\x7fELF no marker")
    assert build_config.embedded_fingerprint(module) is None
    assert build_config.embedded_fingerprint(tmp_path / "missing.so") is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_compiler_flag_puts_the_fingerprint_into_the_binary(tmp_path: Path) -> None:
    value = fingerprint(build_config.HERE)
    library = tmp_path / "fingerprint.so"
    source = build_config.HERE / "build_fingerprint.cpp"
    flag = build_config.fingerprint_define(value)
    subprocess.run(["g++", "-shared", "-fPIC", flag, str(source), "-o", str(library)], check=True, timeout=120)
    assert build_config.embedded_fingerprint(library) == value
    subprocess.run(["g++", "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=120)
    assert build_config.embedded_fingerprint(library) is None  # the run-time build embeds none


def test_setup_py_builds_one_module_per_path_this_cpu_executes(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py as pip runs it, with setuptools' setup() replaced by a recorder: it loads build_config by
    path (kvserve is not importable at install) and asks for each path's module with that path's flags."""
    import setuptools

    recorded: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: recorded.update(kwargs))
    monkeypatch.delenv("KVSERVE_BUILD_CPU_KERNELS", raising=False)
    monkeypatch.delitem(sys.modules, "kvserve_build_config", raising=False)
    setup_py = Path(build_config.__file__).parents[3] / "setup.py"
    runpy.run_path(str(setup_py))
    isas = build_config.executable_isas()
    modules = recorded["ext_modules"]
    assert [m.name for m in modules] == [f"kvserve.kernels.cpu._prebuilt_{isa.name}" for isa in isas]
    for module, isa in zip(modules, isas, strict=True):
        assert module.extra_compile_args["cxx"][: len(build_config.cflags(isa))] == build_config.cflags(isa)
    monkeypatch.setenv("KVSERVE_BUILD_CPU_KERNELS", "generic")  # only the paths named
    runpy.run_path(str(setup_py))
    assert [m.name for m in recorded["ext_modules"]] == ["kvserve.kernels.cpu._prebuilt_generic"]
    monkeypatch.setenv("KVSERVE_BUILD_CPU_KERNELS", "generic,avx1024")
    with pytest.raises(SystemExit, match="KVSERVE_BUILD_CPU_KERNELS=generic,avx1024: avx1024 is not a path"):
        runpy.run_path(str(setup_py))


def fake_prebuilt(monkeypatch: pytest.MonkeyPatch, origin: Path | None) -> None:
    """The avx2 path's install build at `origin` (None: not installed), and no other path's."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name == f"kvserve.kernels.cpu.{build_config.prebuilt_name(AVX2)}":
            return None if origin is None else SimpleNamespace(origin=str(origin))
        if name.startswith(f"kvserve.kernels.cpu.{build_config.PREBUILT_NAME}"):
            return None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_install_build_is_used_only_when_its_fingerprint_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "_prebuilt.so"
    module.write_bytes(build_config.MARKER + b"fp_" + b"1" * 64)
    fake_prebuilt(monkeypatch, module)
    assert cpu.prebuilt_mismatch(AVX2, "1" * 64) is None
    assert "does not fit this machine" in (cpu.prebuilt_mismatch(AVX2, "2" * 64) or "")
    assert "no install build" in (cpu.prebuilt_mismatch(build_config.isa_named("generic"), "1" * 64) or "")
    fake_prebuilt(monkeypatch, None)
    assert "no install build" in (cpu.prebuilt_mismatch(AVX2, "1" * 64) or "")


@pytest.fixture
def fresh_choice() -> object:
    cpu.choice.cache_clear()
    yield
    cpu.choice.cache_clear()


def test_choice_follows_the_environment_variable(monkeypatch: pytest.MonkeyPatch, fresh_choice: object) -> None:
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "generic")
    generic = cpu_isa.selected()
    assert cpu.choice() == cpu.KernelChoice(None, generic, "off", "KVSERVE_CPU_KERNELS=0")
    cpu.choice.cache_clear()
    built = ModuleType("stand_in")
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "jit")
    monkeypatch.setattr(cpu, "build_for_this_cpu", lambda isa, fp, why: built if isa == generic.isa else None)
    assert cpu.choice() == cpu.KernelChoice(built, generic, "run-time build", "KVSERVE_CPU_KERNELS=jit")


def test_a_run_time_build_is_logged_before_and_after_and_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    events: list[str] = []

    def jit_load(name: str, build_directory: str, **kwargs: object) -> ModuleType:
        events.append("compile" if not (Path(build_directory) / f"{name}.so").exists() else "load")
        assert name == "kvserve_cpu_ops_avx2" and Path(build_directory).name.startswith("kvserve_cpu_ops_avx2_py")
        assert kwargs["sources"] == cpu.SOURCES and kwargs["extra_cflags"] == build_config.cflags(AVX2)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return ModuleType(name)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", jit_load)
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.cpu"):
        cpu.build_for_this_cpu(AVX2, "f" * 64, "sources edited")
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        cpu.build_for_this_cpu(AVX2, "f" * 64, "sources edited")  # cached: nothing to announce
        assert caplog.records == []
        cpu.build_for_this_cpu(AVX2, "e" * 64, "sources edited")  # another fingerprint: a build again
    assert (
        first[0].startswith("building CPU kernels for this CPU (avx2 path; first start only, ~")
        and "sources edited" in first[0]
    )
    assert first[1].startswith("built the CPU kernels in ")
    assert events == ["compile", "load", "load"]
    assert "building CPU kernels for this CPU" in caplog.records[0].getMessage()


def test_a_build_leaves_the_flags_and_the_fingerprint_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's JIT builder appends its own link flags to the lists it is given. Handed build_config's own, it
    changed every later fingerprint of the process: the next load in it (after choice.cache_clear) built the
    whole module again under another name, and its stamp sent the next process into a full build as well."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    before = fingerprint(build_config.HERE)

    def jit_load(name: str, build_directory: str, **kwargs: list[str]) -> ModuleType:
        kwargs["extra_ldflags"].append("-ltorch")  # as torch's load does
        kwargs["extra_cflags"].append("-DTORCH_API_INCLUDE_EXTENSION_H")
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return ModuleType(name)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", jit_load)
    cpu.build_for_this_cpu(AVX2, before, "sources edited")
    assert build_config.LDFLAGS == ("-fopenmp",) and "-DTORCH_API_INCLUDE_EXTENSION_H" not in build_config.cflags(AVX2)
    assert fingerprint(build_config.HERE) == before


def test_a_process_waiting_for_another_build_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lock = tmp_path / "kvserve-build.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(1.5)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.cpu"), cpu.exclusive(lock):
        waited = time.monotonic() - started
    holder.wait(timeout=30)
    messages = [r.getMessage() for r in caplog.records]
    assert waited > 0.5  # it did wait for the holder
    assert "another process is building the CPU kernels" in messages[0] and str(lock) in messages[0]
    assert messages[1].startswith("waited ")
