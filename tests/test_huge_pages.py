"""model/huge_pages.py: the weights, their AMX tiles and the KV cache in buffers on transparent huge pages."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.engine.host_memory import keep_freed_memory
from kvserve.engine.startup_report import process_memory_mib
from kvserve.model.huge_pages import (
    ALIGN_BYTES,
    HUGE_PAGE_BYTES,
    RETURN_EVERY_BYTES,
    empty_on_huge_pages,
    move_into_one_buffer,
)

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages_on() -> bool:
    """Linux with THP in "always" or "madvise" mode (the selected mode is the bracketed word)."""
    return sys.platform == "linux" and THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def huge_page_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    holds = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            holds = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif holds and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_moved_tensors_keep_their_values_in_one_aligned_buffer() -> None:
    originals = [torch.randn(5, 7), torch.randn(3), torch.randn(4, 4, 2)]
    tensors = [t.clone() for t in originals]
    holders = {"first": tensors[0]}  # another reference to the same tensor object, as KernelLinear holds one
    buffer = move_into_one_buffer(tensors)
    assert buffer is not None
    for moved, original in zip(tensors, originals, strict=True):
        assert torch.equal(moved, original) and moved.is_contiguous()
        assert moved.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert moved.data_ptr() % ALIGN_BYTES == 0
    # In the order given, without overlap: 5 x 7 floats take 3 cache lines, 3 floats 1.
    starts = [(t.data_ptr() - buffer.data_ptr()) // ALIGN_BYTES for t in tensors]
    assert starts == [0, 3, 4]
    assert holders["first"].data_ptr() == buffer.data_ptr()


def test_a_tensor_listed_twice_is_moved_once() -> None:
    tied = torch.randn(64, 16)  # tied embeddings: embed_tokens is lm_head
    other = torch.randn(16)
    buffer = move_into_one_buffer([tied, other, tied])
    assert buffer is not None and buffer.numel() == 64 * 16 + 16
    assert move_into_one_buffer([]) is None


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status; malloc_trim is glibc's")
def test_moving_does_not_hold_every_tensor_twice() -> None:
    """The originals' pages go back to the kernel while the copies are made: at the end the process holds
    the buffer and at most RETURN_EVERY_BYTES of freed originals, not a second copy of everything."""
    keep_freed_memory()  # as the engine runs: the heap keeps what it frees until told otherwise
    tensors = [torch.ones(2 * 2**20) for _ in range(16)]  # 16 x 8 MiB, from the heap (below its mmap threshold)
    before = process_memory_mib()[0]
    move_into_one_buffer(tensors)
    # The copies replaced the originals: at most RETURN_EVERY_BYTES and one tensor of them still resident.
    assert process_memory_mib()[0] - before < (RETURN_EVERY_BYTES + 8 * 2**20) / 2**20 + 8
    assert all(bool((t == 1).all()) for t in tensors)


def test_mixed_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="one dtype"):
        move_into_one_buffer([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)])


@pytest.mark.skipif(not transparent_huge_pages_on(), reason="needs Linux with transparent huge pages enabled")
def test_a_buffer_written_after_the_advice_sits_on_huge_pages() -> None:
    buffer = empty_on_huge_pages(4 * HUGE_PAGE_BYTES // 2, torch.bfloat16)
    buffer.fill_(1)
    first_whole_page = buffer.data_ptr() + (-buffer.data_ptr() % HUGE_PAGE_BYTES)
    assert huge_page_bytes_at(first_whole_page) >= HUGE_PAGE_BYTES


def test_the_models_projection_weights_and_kv_cache_are_moved(llm_fp32: LLM) -> None:
    engine = llm_fp32.engine
    weights = engine.model.weights
    per_layer = [(layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) for layer in weights.layers]
    projections = [w for layer in per_layer for w in layer]
    buffer = weights.lm_head.untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == buffer for w in projections)
    # In decode order: layer 0's qkv first, each next projection after the one before.
    addresses = [w.data_ptr() for w in projections] + [weights.lm_head.data_ptr()]
    assert addresses == sorted(addresses)
    if transparent_huge_pages_on():
        assert huge_page_bytes_at(weights.layers[0].qkv_proj.data_ptr() + HUGE_PAGE_BYTES) > 0
        assert huge_page_bytes_at(engine.cache.tensor.data_ptr() + HUGE_PAGE_BYTES) > 0
