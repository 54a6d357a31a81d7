"""Tiled prefill never holds the score matrix: its peak extra memory grows linearly with length."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.kernels.attention import tiled_prefill_attention
from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.kernels.peak_memory import peak_extra_memory

HQ, HKV, D = 2, 1, 32


def peak(fn: Callable[..., object], n: int) -> int:
    q, k, v, meta = random_paged_inputs([n], [n], HQ, HKV, D, 16)
    _, nbytes = peak_extra_memory(lambda: fn(q, k, v, meta, D**-0.5))
    return nbytes


def test_prefill_memory_is_linear_in_length() -> None:
    tiled = {n: peak(lambda *a: tiled_prefill_attention(*a, q_tile=64, kv_tile=64), n) for n in (1024, 4096)}
    reference = {n: peak(paged_reference_attention, n) for n in (1024, 4096)}
    # 4x the tokens: about 4x the memory when linear, 16x when the T x T scores are materialized.
    assert tiled[4096] / tiled[1024] < 6
    assert reference[4096] / reference[1024] > 12  # the probe does see quadratic growth
    score_matrix = HQ * 4096 * 4096 * 4
    assert tiled[4096] < score_matrix / 8
