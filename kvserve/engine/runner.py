"""Packs one scheduled iteration into tensors, runs the model, and returns the logits it needs.

Row order of the returned logits: for each span in order, its last `num_logits` query positions.
Batch metadata is built with one pass over the spans and one tensor copy per field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kernels.backends import AttentionBackend
from kvserve.kernels.metadata import AttentionMetadata
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
        bs = self.cache.block_size
        tokens: list[int] = []
        logit_rows: list[int] = []
        for span in spans:
            tokens.extend(span.tokens)
            logit_rows.extend(range(len(tokens) - span.num_logits, len(tokens)))
        q_lens = np.fromiter((len(s.tokens) for s in spans), dtype=np.int64, count=len(spans))
        starts = np.fromiter((s.start for s in spans), dtype=np.int64, count=len(spans))
        seq_lens = starts + q_lens
        # positions: start_i + 0..q_len_i-1 for each span, built without a per-token loop.
        offsets = np.arange(q_lens.sum()) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        positions = np.repeat(starts, q_lens) + offsets
        width = max(len(s.block_table) for s in spans)
        table_array = np.zeros((len(spans), width), dtype=np.int64)
        for i, span in enumerate(spans):
            table_array[i, : len(span.block_table)] = span.block_table
        slots = table_array[np.repeat(np.arange(len(spans)), q_lens), positions // bs] * bs + positions % bs

        device = self.model.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)])).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_tables=torch.from_numpy(table_array).to(device),
            query_lens_host=q_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
            block_size=bs,
        )
        with decode_step(all(span.decoding for span in spans)):
            hidden = self.model.forward(
                torch.tensor(tokens, dtype=torch.int64, device=device),
                torch.from_numpy(positions).to(device),
                self.cache.tensor,
                torch.from_numpy(slots).to(device),
                meta,
                self.attention,
                num_layers=num_layers,
                compiled_decode=self.compiled_decode and self.attention.decode_kernel_takes_every_row(meta),
            )
            if not logit_rows:
                return hidden.new_empty((0, self.model.config.vocab_size))  # the model dtype, as logits() gives
            if len(logit_rows) < len(tokens):  # rows are ascending and distinct: equal counts mean every row
                hidden = hidden[torch.tensor(logit_rows, device=device)]
            return self.model.logits(hidden)
