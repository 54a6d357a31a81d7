"""Packs one scheduled iteration into tensors, runs the model, and returns the logits it needs.

Row order of the returned logits: for each span in order, its last `num_logits` query positions.
Batch metadata is built with one pass over the spans and one tensor copy per field (pack_spans).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kernels.backends import AttentionBackend
from kvserve.kernels.metadata import AttentionMetadata, int64_tensor
from kvserve.model.huge_pages import empty_on_huge_pages
from kvserve.model.llama import LlamaModel
from kvserve.model.quantized_linear import decode_step


class KVCache:
    """All layers' K and V blocks in one tensor: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.block_size = block_size
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        if model.device.type == "cpu":  # batched decode streams it: on huge pages (model/huge_pages.py)
            self.tensor = empty_on_huge_pages(math.prod(shape), model.dtype).view(shape).zero_()
        else:
            self.tensor = torch.zeros(shape, dtype=model.dtype, device=model.device)

    @staticmethod
    def bytes_per_block(model: LlamaModel, block_size: int) -> int:
        cfg = model.config
        elem = torch.empty((), dtype=model.dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.tensor.device)
            dst = torch.tensor([d for _, d in copies], device=self.tensor.device)
            self.tensor[:, :, dst] = self.tensor[:, :, src]


@dataclass
class Span:
    """New tokens of one sequence for one forward pass: `tokens` sit at positions start.. in `block_table`."""

    tokens: list[int]
    start: int
    block_table: list[int]
    num_logits: int  # trailing rows whose logits are needed
    decoding: bool  # the tokens follow generated ones (decode, verify, draft rows), not the prompt's


def spans_of(sched: SchedulerOutput) -> list[Span]:
    """The scheduled work as spans; a decoding sequence's span ends with its draft tokens to verify."""
    spans = []
    for item in sched.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start : start + item.num_new_tokens]
        tokens += seq.spec_tokens[: item.num_new_tokens - len(tokens)]
        spans.append(Span(tokens, start, seq.block_table, item.num_logits, decoding=not seq.in_prefill))
    return spans


@dataclass
class PackedSpans:
    """The spans' new tokens back to back, as the model's forward takes them."""

    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]: each token's cache slot, block id * block_size + offset
    meta: AttentionMetadata
    logit_rows: list[int]  # the rows whose logits are needed, ascending


def cache_slots(block_table: list[int], start: int, count: int, block_size: int) -> list[int]:
    """The cache slots of positions start .. start + count - 1 (block_table[p // block_size] * block_size
    + p % block_size), one range per block they touch."""
    slots: list[int] = []
    position, end = start, start + count
    while position < end:
        block = position // block_size
        block_end = min((block + 1) * block_size, end)
        shift = (block_table[block] - block) * block_size  # slot = position + shift within the block
        slots += range(position + shift, block_end + shift)
        position = block_end
    return slots


def pack_spans(spans: list[Span], block_size: int, device: torch.device) -> PackedSpans:
    """One pass over the spans in Python lists, then one tensor per field. The loops run per span and per
    block, not per token; numpy's vector operations, which the positions and slots took before, cost more
    per call than these loops in a decode step, whose spans hold one token each."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    for span in spans:
        count = len(span.tokens)
        tokens += span.tokens
        positions += range(span.start, span.start + count)
        slots += cache_slots(span.block_table, span.start, count, block_size)
        logit_rows += range(len(tokens) - span.num_logits, len(tokens))
    meta = AttentionMetadata.build(
        [len(span.tokens) for span in spans],
        [span.start + len(span.tokens) for span in spans],
        [span.block_table for span in spans],
        block_size,
        device,
    )
    return PackedSpans(
        token_ids=int64_tensor(tokens, device),
        positions=int64_tensor(positions, device),
        slots=int64_tensor(slots, device),
        meta=meta,
        logit_rows=logit_rows,
    )


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, attention: AttentionBackend) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        # Whether steps of decode rows may run as one compiled call (LlamaModel.forward); tests turn it off
        # to compare with the Python loop.
        self.compiled_decode = attention.compiled_decode

    def execute(self, spans: list[Span], num_layers: int | None = None) -> torch.Tensor:
        """Forward pass over the spans; logits [rows, vocab] in the model dtype (rows in span order)."""
        device = self.model.device
        inputs = pack_spans(spans, self.cache.block_size, device)
        with decode_step(all(span.decoding for span in spans)):
            hidden = self.model.forward(
                inputs.token_ids,
                inputs.positions,
                self.cache.tensor,
                inputs.slots,
                inputs.meta,
                self.attention,
                num_layers=num_layers,
                compiled_decode=self.compiled_decode and self.attention.decode_kernel_takes_every_row(inputs.meta),
            )
            rows = inputs.logit_rows
            if not rows:
                return hidden.new_empty((0, self.model.config.vocab_size))  # the model dtype, as logits() gives
            if len(rows) < hidden.shape[0]:  # rows are ascending and distinct: equal counts mean every row
                hidden = hidden[torch.tensor(rows, device=device)]
            return self.model.logits(hidden)
