"""The runner's packing of spans into the forward's tensors, against the per-token definition of each field
(kvserve/kernels/metadata.py: a sequence's keys are positions 0 .. seq_len - 1 found through its block table)."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.engine.runner import Span, cache_slots, pack_spans

BLOCK_SIZE = 16


def random_span(rng: random.Random, count: int, num_logits: int) -> Span:
    start = rng.randrange(0, 70)
    blocks = (start + count + BLOCK_SIZE - 1) // BLOCK_SIZE + rng.randrange(0, 2)  # some tables hold a spare block
    return Span(
        tokens=[rng.randrange(50_000) for _ in range(count)],
        start=start,
        block_table=rng.sample(range(1_000), blocks),
        num_logits=num_logits,
        decoding=count == 1,
    )


def test_cache_slots_follow_the_block_table_across_block_boundaries() -> None:
    table = [7, 3, 12]
    assert cache_slots(table, 14, 5, 16) == [7 * 16 + 14, 7 * 16 + 15, 3 * 16, 3 * 16 + 1, 3 * 16 + 2]
    assert cache_slots(table, 32, 1, 16) == [12 * 16]
    assert cache_slots(table, 0, 48, 16) == [b * 16 + o for b in table for o in range(16)]
    assert cache_slots(table, 5, 0, 16) == []


@pytest.mark.parametrize("shape", ["decode", "prefill", "mixed"])
def test_pack_spans_matches_the_per_token_definition(shape: str) -> None:
    rng = random.Random(hash(shape) % 1000)
    counts = {"decode": [1] * 9, "prefill": [37, 5, 64], "mixed": [1, 23, 1, 1, 40, 3]}[shape]
    spans = [random_span(rng, count, num_logits=rng.choice([0, 1, min(count, 2)])) for count in counts]
    packed = pack_spans(spans, BLOCK_SIZE, torch.device("cpu"))

    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    for span in spans:
        for i, token in enumerate(span.tokens):
            p = span.start + i
            tokens.append(token)
            positions.append(p)
            slots.append(span.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        logit_rows += range(len(tokens) - span.num_logits, len(tokens))
    assert packed.token_ids.tolist() == tokens
    assert packed.positions.tolist() == positions
    assert packed.slots.tolist() == slots
    assert packed.logit_rows == logit_rows
    assert all(t.dtype == torch.int64 for t in (packed.token_ids, packed.positions, packed.slots))

    meta = packed.meta
    assert meta.query_lens_host == counts
    assert meta.seq_lens_host == [s.start + len(s.tokens) for s in spans]
    assert meta.seq_lens.tolist() == meta.seq_lens_host
    assert meta.cu_seqlens_q.tolist() == [sum(counts[:i]) for i in range(len(counts) + 1)]
    width = max(len(s.block_table) for s in spans)
    assert meta.block_tables.shape == (len(spans), width)
    for row, span in zip(meta.block_tables.tolist(), spans, strict=True):
        assert row[: len(span.block_table)] == span.block_table  # the rest is padding, masked by seq_lens
    assert meta.block_size == BLOCK_SIZE
