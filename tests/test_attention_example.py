"""Book §31.4, Example 31.2: combine tile statistics, not tile averages."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.kernels.attention import M_FLOOR, merge_attention_states, paged_decode_attention
from kvserve.kernels.metadata import AttentionMetadata

WEIGHTS = [4.0, 2.0, 1.0, 1.0]  # unnormalized softmax weights exp(s_k) of one query
VALUES = [1.0, 3.0, 0.0, 2.0]


def tile_state(weights: list[float], values: list[float]) -> tuple[torch.Tensor, ...]:
    """(m, den, acc) of one tile, relative to the tile's own max as the kernel keeps it."""
    s = torch.log(torch.tensor(weights, dtype=torch.float64))
    m = s.max()
    p = torch.exp(s - m)
    return m, p.sum(), (p * torch.tensor(values, dtype=torch.float64)).sum().unsqueeze(-1)


def test_tile_statistics_are_numerator_and_denominator() -> None:
    m1, den1, acc1 = tile_state(WEIGHTS[:2], VALUES[:2])
    m2, den2, acc2 = tile_state(WEIGHTS[2:], VALUES[2:])
    # Brought back to absolute scale, the statistics are the book's (numerator, denominator).
    assert (math.exp(m1) * acc1.item(), math.exp(m1) * den1.item()) == pytest.approx((10, 6))
    assert (math.exp(m2) * acc2.item(), math.exp(m2) * den2.item()) == pytest.approx((2, 2))


def test_combining_statistics_gives_the_full_output_and_averaging_does_not() -> None:
    tile1 = tile_state(WEIGHTS[:2], VALUES[:2])
    tile2 = tile_state(WEIGHTS[2:], VALUES[2:])
    _, den, acc = merge_attention_states(*tile1, *tile2)
    assert (acc / den).item() == pytest.approx(1.5)  # (10 + 2) / (6 + 2)
    averaged = ((tile1[2] / tile1[1]).item() + (tile2[2] / tile2[1]).item()) / 2
    assert averaged == pytest.approx(4 / 3)  # (10/6 + 2/2) / 2: tiles carry unequal mass
    assert averaged != pytest.approx(1.5)


def test_merge_with_an_empty_state_is_the_identity() -> None:
    empty = (torch.tensor(M_FLOOR), torch.tensor(0.0), torch.zeros(1))
    tile = (torch.tensor(1e4), torch.tensor(2.0), torch.tensor([3.0]))
    for merged in (merge_attention_states(*empty, *tile), merge_attention_states(*tile, *empty)):
        assert [x.item() for x in merged] == [1e4, 2.0, 3.0]


@pytest.mark.parametrize("num_splits", [1, 2])
def test_kernel_reproduces_the_example(num_splits: int) -> None:
    """One query attending to four keys in two KV tiles of two: scores log(w), head dim 1."""
    keys = torch.log(torch.tensor(WEIGHTS)).view(1, 4, 1, 1)  # one block of 4 slots
    values = torch.tensor(VALUES).view(1, 4, 1, 1)
    q = torch.ones(1, 1, 1)
    meta = AttentionMetadata.build([1], [4], [[0]], block_size=4)
    out = paged_decode_attention(q, keys, values, meta, scale=1.0, kv_tile=2, num_splits=num_splits)
    assert out.item() == pytest.approx(1.5, rel=1e-6)
