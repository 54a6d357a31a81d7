"""Packs one scheduled iteration into tensors, runs the model, and returns the logits it needs.

Row order of the returned logits: for each scheduled sequence in order, its last `num_logits` query
positions. Batch metadata is built with one pass over the sequences and one tensor copy per field.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.model.llama import AttentionFn, LlamaModel


class KVCache:
    """All layers' K and V blocks in one tensor: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.block_size = block_size
        self.tensor = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=model.dtype, device=model.device,
        )  # fmt: skip

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


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, attention: AttentionFn) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention

    def execute(self, sched: SchedulerOutput, num_layers: int | None = None) -> torch.Tensor:
        """Forward pass for the scheduled tokens; logits [rows, vocab] float32."""
        self.cache.copy_blocks(sched.block_copies)
        bs = self.cache.block_size
        tokens: list[int] = []
        starts, query_lens, seq_lens, tables, logit_rows = [], [], [], [], []
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            span = seq.token_ids[start:end]
            if len(span) < item.num_new_tokens:  # the tail is draft tokens awaiting verification
                span = span + seq.spec_tokens[: item.num_new_tokens - len(span)]
            tokens.extend(span)
            starts.append(start)
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(seq.block_table)
            row += item.num_new_tokens
            logit_rows.extend(range(row - item.num_logits, row))

        q_lens = np.asarray(query_lens, dtype=np.int64)
        # positions: start_i + 0..q_len_i-1 for each sequence, built without a per-token loop.
        offsets = np.arange(q_lens.sum()) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        positions = np.repeat(np.asarray(starts, dtype=np.int64), q_lens) + offsets
        width = max(len(t) for t in tables)
        table_array = np.zeros((len(tables), width), dtype=np.int64)
        for i, table in enumerate(tables):
            table_array[i, : len(table)] = table
        seq_index = np.repeat(np.arange(len(tables)), q_lens)
        slots = table_array[seq_index, positions // bs] * bs + positions % bs

        device = self.model.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)])).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=torch.from_numpy(table_array).to(device),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        hidden = self.model.forward(
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.from_numpy(positions).to(device),
            self.cache.tensor,
            torch.from_numpy(slots).to(device),
            meta,
            self.attention,
            num_layers=num_layers,
        )
        if not logit_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(logit_rows, device=device)])
