"""decode_attention_key_split.h: few decode rows with their keys split among the threads, each part on a
vector kernel (AVX512-BF16 where the build has it, else the widened float32 one) and the parts merged by
their log-sum-exp. Checked against the float64 oracle and against the same call with the split switched
off (set_attention_key_split), on 2 threads, where the split applies and where it must not."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention_cpu import cpu_attention
from kvserve.kernels.attention_ref import climbing_score_inputs, paged_reference_attention, random_paged_inputs
from kvserve.kernels.cpu import isa as cpu_isa


@pytest.fixture
def kernels():
    built = cpu.load()
    if built is None:
        pytest.skip("the C++ kernels are not built")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    previous_amx = built.set_amx_attention(False)  # the split is for the vector kernels
    yield built
    built.set_amx_attention(previous_amx)
    built.set_bf16_attention(True)
    built.set_attention_key_split(True)
    torch.set_num_threads(previous_threads)


def kernel_runs() -> list[tuple[torch.dtype, bool]]:
    """(cache dtype, AVX512-BF16 kernel allowed) for each vector kernel this build runs: float32 caches and
    bf16 ones on the widened kernel, bf16 ones on the AVX512-BF16 kernel where the build has it."""
    runs = [(torch.float32, False), (torch.bfloat16, False)]
    return runs + [(torch.bfloat16, True)] if cpu_isa.selected().bf16 else runs


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def attention(kernels, inputs, scale: float, window: int | None, *, bf16: bool, split: bool) -> torch.Tensor:
    q, k, v, meta = inputs
    kernels.set_bf16_attention(bf16)
    kernels.set_attention_key_split(split)
    return cpu_attention(q, k, v, meta, scale, window=window)


SPLIT_CASES = [
    # (seq_lens, heads, kv_heads, head_dim, block_size, window): one decode row per sequence, an odd
    # number of items (sequences times KV heads) for 2 threads, long enough for the split to pay
    # one SmolLM2 row at a long context: 2 parts of 1024 keys
    ([2048], 9, 3, 64, 16, None),
    # parts of 850 keys: the earlier ends two keys into a block
    ([1700], 9, 3, 64, 16, None),
    # Gemma 3's heads (4 per KV head, dim 256), in blocks of 32; and within its sliding window
    ([600], 4, 1, 256, 32, None),
    ([512], 4, 1, 256, 16, 512),
    # its window cutting the keys: 2 parts of 256 tile the last 512, which start one key into a block
    ([1041], 4, 1, 256, 16, 512),
    # three sequences, two longer than the window, one shorter; the parts tile a window of 400 keys
    ([2000, 300, 999], 6, 3, 256, 16, 400),
    # 3 sequences, 2 parts of the longest, the others whole; one-key blocks, head dim 128
    ([1100, 64, 300], 9, 3, 128, 1, None),
    # head dim 32 in blocks of 5
    ([4000], 6, 3, 32, 5, None),
]


@pytest.mark.parametrize(("seq_lens", "heads", "kv_heads", "head_dim", "block_size", "window"), SPLIT_CASES)
def test_split_rows_match_the_oracle_and_the_unsplit_kernel(
    kernels, seq_lens, heads, kv_heads, head_dim, block_size, window
) -> None:
    scale = head_dim**-0.5
    for dtype, bf16 in kernel_runs():
        inputs = random_paged_inputs([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, block_size, dtype, 3)
        q, k, v, meta = inputs
        ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64, window)
        split = attention(kernels, inputs, scale, window, bf16=bf16, split=True)
        whole = attention(kernels, inputs, scale, window, bf16=bf16, split=False)
        assert relative_error(split, ref) < 1e-2
        assert relative_error(whole, ref) < 1e-2
        # The parts are normalized and merged in float32, then rounded once: the two differ by rounding only.
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(split, whole.double()) < tolerance
        if dtype == torch.float32 or bf16:
            # The widened kernel's bf16 rows round its float32 sums, which the split changes by ~1e-7 only:
            # float32 rows, or the bf16 kernel's bf16 probabilities, show that the split ran.
            assert not torch.equal(split, whole), "the split did not run"


def test_split_merges_parts_whose_scores_differ_by_hundreds(kernels) -> None:
    """Scores climbing by 1 per key: the early part's log-sum-exp lies hundreds below the last part's, so
    its weight underflows to 0 and the merge must still give the oracle's row, finite."""
    q, k, v, meta = climbing_score_inputs([1], [2048])
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 10.0, torch.float64)
    for dtype, bf16 in kernel_runs():
        inputs = (q.to(dtype), k.to(dtype), v.to(dtype), meta)
        out = attention(kernels, inputs, 10.0, None, bf16=bf16, split=True).double()
        assert torch.isfinite(out).all()
        assert relative_error(out, ref) < 1e-2


NO_SPLIT_CASES = [
    # (query_lens, seq_lens, heads, kv_heads, head_dim, window): why no split applies
    ([1], [511], 9, 3, 64, None),  # too short: the busiest thread's excess is below kMinExcessBytes
    ([1, 1], [1024, 1024], 9, 3, 64, None),  # 6 items: the threads' shares are equal already
    ([1, 1, 1], [2048] * 3, 4, 1, 256, None),  # several sequences of a single KV head
    ([1, 1, 1, 1], [1024] * 4, 9, 3, 64, None),  # 2 sequences per thread: whole sequences already share out
    ([2], [1024], 4, 1, 256, None),  # a verify row of 2 tokens, not a decode row
    ([1], [2048], 4, 1, 256, 1001),  # a window that cuts the keys and 2 parts cannot tile exactly
]


@pytest.mark.parametrize(("query_lens", "seq_lens", "heads", "kv_heads", "head_dim", "window"), NO_SPLIT_CASES)
def test_no_split_where_it_does_not_apply(kernels, query_lens, seq_lens, heads, kv_heads, head_dim, window) -> None:
    for dtype, bf16 in kernel_runs():
        inputs = random_paged_inputs(query_lens, seq_lens, heads, kv_heads, head_dim, 16, dtype, 4)
        split = attention(kernels, inputs, 0.125, window, bf16=bf16, split=True)
        whole = attention(kernels, inputs, 0.125, window, bf16=bf16, split=False)
        assert torch.equal(split, whole)


def test_one_thread_never_splits(kernels) -> None:
    inputs = random_paged_inputs([1], [2048], 9, 3, 64, 16, torch.float32, 5)
    torch.set_num_threads(1)
    split = attention(kernels, inputs, 0.125, None, bf16=False, split=True)
    whole = attention(kernels, inputs, 0.125, None, bf16=False, split=False)
    assert torch.equal(split, whole)
