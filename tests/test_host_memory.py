"""keep_freed_memory (engine/host_memory.py): a freed activation-sized block is reused, not re-faulted.

Each case runs in a fresh interpreter, since the setting is for the whole process and glibc's own
thresholds drift with what the process has freed before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.engine.host_memory import USER_SETTINGS

# Faults while tensors of 8-12 MB (a prefill step's activations) are allocated, filled and freed in
# turn. glibc's default serves each from a fresh mmap() (each is at or above the threshold the previous
# free moved it to): 18,400-20,500 faults measured. Kept, the heap grows only by each new maximum
# (3,100-3,300).
PROBE = """
import resource, sys, torch
from kvserve.engine.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def cycle(mb):
    x = torch.ones(mb * 2**19, dtype=torch.bfloat16)
    del x
cycle(8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mb in (8, 9, 10, 11, 12, 8, 10, 12):
    cycle(mb)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}  # glibc's defaults, not the user's
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    default, kept = faults("default"), faults("keep")
    assert default > 12_000  # the probe sees the faults it is meant to remove
    assert kept < 5_000


def test_the_users_own_malloc_settings_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.engine.host_memory import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert keep_freed_memory() is False


# Resident MB after 40 MB of heap blocks (each below the kept mmap threshold) are freed, then after
# return_freed_memory: the kept heap holds on to them until it is asked to give them back.
RETURN_PROBE = """
import os, torch
from kvserve.engine.host_memory import keep_freed_memory, return_freed_memory
def resident_mb():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
assert keep_freed_memory()
blocks = [torch.ones(2**20) for _ in range(10)]  # 10 x 4 MB
del blocks
kept = resident_mb()
assert return_freed_memory()
print(kept - resident_mb())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_return_freed_memory_gives_the_kept_heap_back() -> None:
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", RETURN_PROBE], capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout.strip()) > 30  # of the 40 MB freed


# Resident MB given back by return_freed_memory_beyond(retained) after 40 MB of heap blocks are freed:
# nothing while the free heap is within the retained amount, most of it once the amount is smaller.
BEYOND_PROBE = """
import os, sys, torch
from kvserve.engine.host_memory import free_heap_bytes, keep_freed_memory, return_freed_memory_beyond
def resident_mb():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
assert keep_freed_memory()
blocks = [torch.ones(2**20) for _ in range(10)]  # 10 x 4 MB
del blocks
assert free_heap_bytes() >= 40 * 2**20
kept = resident_mb()
returned = return_freed_memory_beyond(int(sys.argv[1]) * 2**20)
print(returned, kept - resident_mb())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_return_freed_memory_beyond_keeps_what_it_may_and_returns_the_excess() -> None:
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}

    def run(retained_mb: int) -> tuple[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", BEYOND_PROBE, str(retained_mb)], capture_output=True, text=True, env=env, check=True
        )
        returned, given_back = out.stdout.split()
        return returned, float(given_back)

    returned, given_back = run(256)
    assert returned == "False" and given_back < 5
    returned, given_back = run(8)
    assert returned == "True" and given_back > 30
