"""The CPU kernels' instruction-set paths (build_config.ISAS, kernels/cpu/isa.py): which paths a CPU can
execute, what KVSERVE_CPU_ISA may force and how a refusal reads, the compiler flags that keep each build
below its path (checked against the compiler's predefined macros, the ones the kernels' #ifdefs test),
and the kernel tests run again under every path this CPU executes besides its default one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.kernels.cpu.isa import IsaError, choose

ROOT = Path(__file__).resolve().parents[1]
# /proc/cpuinfo flags of real CPUs, trimmed to what the paths read.
ZEN2 = ["sse4_2", "avx", "avx2", "fma", "f16c"]
SKYLAKE_X = [*ZEN2, "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]
ZEN4 = [*SKYLAKE_X, "avx512_bf16"]
SAPPHIRE_RAPIDS = [*ZEN4, "amx_tile", "amx_bf16", "amx_int8"]


def names(isas: list[build_config.Isa]) -> list[str]:
    return [isa.name for isa in isas]


def test_a_cpu_executes_every_path_up_to_its_best() -> None:
    assert build_config.ISA_NAMES == ("generic", "avx2", "avx512", "amx")
    assert names(build_config.executable_isas([])) == ["generic"]  # another architecture, or no /proc/cpuinfo
    assert names(build_config.executable_isas(["avx2", "fma"])) == ["generic"]  # no F16C
    assert names(build_config.executable_isas(ZEN2)) == ["generic", "avx2"]
    assert names(build_config.executable_isas(SKYLAKE_X)) == ["generic", "avx2", "avx512"]
    assert names(build_config.executable_isas([*ZEN4, "amx_tile"])) == ["generic", "avx2", "avx512"]  # no AMX-BF16
    assert names(build_config.executable_isas(SAPPHIRE_RAPIDS)) == ["generic", "avx2", "avx512", "amx"]


def test_the_default_is_the_best_path_and_bf16_hardware_follows_the_path() -> None:
    best = choose(None, SAPPHIRE_RAPIDS)
    assert (best.isa.name, best.best.name, best.forced, best.bf16) == ("amx", "amx", False, True)
    assert best.describe() == "amx (this CPU's best)"
    assert choose("", ZEN2).describe() == "avx2 (this CPU's best)" and not choose("", ZEN2).bf16
    assert not choose(None, SKYLAKE_X).bf16 and choose(None, SKYLAKE_X).describe() == "avx512 (this CPU's best)"
    assert choose(None, ZEN4).bf16 and choose(None, ZEN4).describe() == "avx512 with AVX512-BF16 (this CPU's best)"
    forced = choose("avx2", SAPPHIRE_RAPIDS)
    assert (forced.isa.name, forced.best.name, forced.forced, forced.bf16) == ("avx2", "amx", True, False)
    assert forced.describe() == "avx2 (forced by KVSERVE_CPU_ISA; this CPU runs up to amx)"
    assert choose("avx512", SAPPHIRE_RAPIDS).bf16  # AMX off, AVX512-BF16 still there
    assert not choose("generic", SAPPHIRE_RAPIDS).bf16
    assert choose("amx", SAPPHIRE_RAPIDS).forced  # naming the best path is still forcing it


def test_a_path_the_cpu_cannot_execute_or_an_unknown_name_is_refused_naming_the_variable() -> None:
    with pytest.raises(IsaError) as refused:
        choose("avx512", ZEN2)
    assert str(refused.value) == (
        "KVSERVE_CPU_ISA=avx512: this CPU cannot execute the avx512 path (it lacks avx512f, avx512bw, avx512vl); "
        "it runs generic, avx2"
    )
    with pytest.raises(
        IsaError, match=r"KVSERVE_CPU_ISA=amx: .* lacks amx_tile, amx_bf16\); it runs generic, avx2, avx512$"
    ):
        choose("amx", ZEN4)
    with pytest.raises(IsaError) as unknown:
        choose("AVX2", ZEN2)  # names are lower case, as in /proc/cpuinfo
    assert str(unknown.value) == (
        "KVSERVE_CPU_ISA='AVX2' is not a CPU kernel path: use one of generic, avx2, avx512, amx "
        "(this CPU runs generic, avx2)"
    )
    assert issubclass(IsaError, ValueError)  # the CLI prints a ValueError as one line and exits 2


def test_a_forced_path_caps_torchs_own_cpu_code_unless_the_user_did() -> None:
    assert set(cpu_isa.TORCH_CAPS) == set(build_config.ISA_NAMES)
    environ = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert cpu_isa.cap_torch(choose("avx2", SAPPHIRE_RAPIDS), environ) == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert environ == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx2"}
    untouched: dict[str, str] = {}
    assert cpu_isa.cap_torch(choose(None, ZEN2), untouched) == {} and untouched == {}  # the best path: no caps
    assert cpu_isa.cap_torch(choose("amx", SAPPHIRE_RAPIDS), untouched) == {} and untouched == {}


PRESENT_ABSENT = {
    "generic": ((), ("__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AMX_TILE__", "__AMX_BF16__")),
    "avx2": (("__AVX2__", "__FMA__", "__F16C__"), ("__AVX512F__", "__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__")),
    "avx512": (("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512BF16__"), ("__AMX_TILE__", "__AMX_BF16__")),
    "amx": (("__AVX512F__", "__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__"), ()),
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("isa", build_config.ISAS, ids=build_config.ISA_NAMES)
def test_each_paths_flags_keep_the_build_below_it(isa: build_config.Isa) -> None:
    """The flags with -march=native replaced by an AMX CPU's, so every switch has something to switch off."""
    flags = ["-march=sapphirerapids" if f == "-march=native" else f for f in build_config.cflags(isa, "x86_64")]
    proc = subprocess.run(["g++", *flags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True)
    if proc.returncode != 0 and "sapphirerapids" in proc.stderr:
        pytest.skip("this g++ predates -march=sapphirerapids (GCC 11)")
    assert proc.returncode == 0, proc.stderr
    macros = {line.split()[1] for line in proc.stdout.splitlines()}
    present, absent = PRESENT_ABSENT[isa.name]
    assert macros.issuperset(present) and macros.isdisjoint(absent), sorted(
        m for m in macros if "AVX" in m or "AMX" in m
    )
    assert build_config.cflags(isa, "aarch64") == list(build_config.CFLAGS)  # x86 switches only on x86


@pytest.fixture
def fresh_choice() -> object:
    cpu.choice.cache_clear()
    yield
    cpu.choice.cache_clear()


def test_the_kernel_choice_raises_rather_than_falling_back(
    monkeypatch: pytest.MonkeyPatch, fresh_choice: object
) -> None:
    """choice() turns build failures into the torch-ops fallback; a refused KVSERVE_CPU_ISA is not one."""
    monkeypatch.setenv("KVSERVE_CPU_ISA", "sse")
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    with pytest.raises(IsaError, match="KVSERVE_CPU_ISA='sse'"):
        cpu.choice()


def run_cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI with `env` added to this process's environment, less any torch caps set in it."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        cwd=ROOT,
        env={**inherited, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def refused_values() -> list[str]:
    """An unknown name, and the lowest path this CPU cannot execute (where there is one)."""
    above = build_config.ISAS[len(build_config.executable_isas()) :]
    return ["avx1024", *(isa.name for isa in above[:1])]


@pytest.mark.parametrize("value", refused_values())
def test_kvserve_refuses_to_start_on_a_path_this_cpu_cannot_execute(value: str) -> None:
    proc = run_cli(["info"], KVSERVE_CPU_ISA=value)
    assert proc.returncode == 2, proc.stderr
    shown = value if value in build_config.ISA_NAMES else repr(value)
    assert proc.stderr.splitlines()[-1].startswith(f"error: KVSERVE_CPU_ISA={shown}"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_info_names_a_forced_path_and_decides_as_that_cpu_would() -> None:
    """generic has no bf16 hardware and, with the kernels off, no GEMV: --dtype auto is float32 on every CPU
    (on one with AVX512-BF16 or AMX it would be bf16 if the path were not forced); torch's ATen kernels run
    their portable form (the cap took effect: ATen reports what it uses)."""
    proc = run_cli(["info", "--json", "--num-kv-blocks", "16"], KVSERVE_CPU_ISA="generic", KVSERVE_CPU_KERNELS="0")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    best = build_config.executable_isas()[-1].name
    assert rows["cpu path"] == f"generic (forced by KVSERVE_CPU_ISA; this CPU runs up to {best})"
    assert rows["dtype"] == "float32 (--dtype auto)"
    assert rows["torch cpu ops"] == "ATen DEFAULT, oneDNN up to SSE41"


KERNEL_TESTS = ["tests/test_cpu_ops.py", "tests/test_quantized_kernels.py", "tests/test_decode_layers.py"]
# The paths the rest of the suite does not run the kernels under: all but this process's own.
OTHER_PATHS = [isa.name for isa in build_config.executable_isas() if isa != cpu_isa.selected().isa]
# Runs pytest in-process, then says which module the kernels were loaded from.
RUN_AND_NAME_THE_MODULE = (
    "import sys, pytest\n"
    "code = pytest.main(sys.argv[1:])\n"
    "from kvserve.kernels import cpu\n"
    "print('kernel module:', getattr(cpu.load(), '__name__', None))\n"
    "sys.exit(code)\n"
)


@pytest.mark.parametrize(
    "name", OTHER_PATHS or [pytest.param(None, marks=pytest.mark.skip(reason="this CPU executes only one path"))]
)
def test_the_kernel_tests_pass_under_every_other_path_this_cpu_executes(name: str) -> None:
    """The first run of a path without an install build compiles it (minutes, cached after). torch's own
    ops are held to the path as the CLI holds them (cap_torch), so the choices made by timing them (the
    batched product's probe) are the ones that CPU would make."""
    env = {key: value for key, value in os.environ.items() if key != "KVSERVE_CPU_KERNELS"}
    cpu_isa.cap_torch(cpu_isa.choose(name, build_config.cpu_features()), env)
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AND_NAME_THE_MODULE, "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT,
        env={**env, "KVSERVE_CPU_ISA": name},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].endswith(f"_{name}"), proc.stdout[-500:]
