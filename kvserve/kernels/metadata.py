"""What every attention backend needs to know about one packed batch.

The batch packs B sequences' new tokens back to back (no padding): sequence i owns query rows
cu_seqlens_q[i] : cu_seqlens_q[i+1]. Its K/V for *all* positions, cached prefix and new tokens alike,
live in the paged cache and have already been written before attention runs. So the keys of
sequence i are positions 0 .. seq_lens[i]-1, found through block_tables[i], and its query rows are
the last query_lens[i] of those positions (causal: a query at position p sees keys 0..p).

Invariant: seq_lens[i] >= query_lens[i] >= 1, and block_tables[i, : ceil(seq_lens[i] / block_size)]
are valid block ids; entries beyond that are padding (any valid id) and must be masked by seq_lens.
Released slots: when every layer of the model has a window W, the entries of the blocks wholly before
position (seq_lens[i] - query_lens[i]) - W + 1, the first key sequence i's first query row sees, may be
released (engine/sequence.py's RELEASED_SLOT): a valid id, but the block may hold another sequence's K/V.
No backend lets such a key into its result: the compiled CPU kernel, the tiled kernel and the Triton
kernels start reading at the block of that first window key and never read the entry; sdpa and the
reference gather it and mask it with the window, and since every block of the cache holds finite values
(zeroed when the cache is made, then written only with K/V), a masked key's score is -inf, its weight
exactly 0 and 0 x its finite value adds nothing (no NaN).
Host-side copies of the lengths are kept so backends can plan loops without a device sync.

One metadata object serves every layer of a forward pass, so backends memoize what depends only on
it (index tensors, masks, loop bounds) in `plans`, keyed by backend and parameters, and reuse it for
the other layers. The metadata must therefore not be modified after its first use: build a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
import torch

# An attention backend: (q, k_cache, v_cache, meta, scale, window=None) -> the output rows (backends.py).
AttentionFn = Callable[..., torch.Tensor]


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int64 [B+1], on the compute device
    seq_lens: torch.Tensor  # int64 [B], total keys per sequence after this step's writes
    block_tables: torch.Tensor  # int64 [B, max_blocks_per_seq]
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_size: int
    # Per-batch work memoized by backends (see the module docstring); not part of the value.
    plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from host lists (one tensor copy each; used by the runner and by tests)."""
        if len(query_lens) != len(seq_lens) or len(seq_lens) != len(block_tables):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            cu_seqlens_q=int64_tensor([0, *accumulate(query_lens)], device),
            seq_lens=int64_tensor(seq_lens, device),
            block_tables=int64_tensor(padded, device).reshape(len(padded), width),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
            block_size=block_size,
        )


def int64_tensor(values: list[int] | list[list[int]], device: torch.device | str) -> torch.Tensor:
    """`values` (a list, or a list of equally long lists) as an int64 tensor on `device`, through numpy,
    which converts a Python list about three times faster than torch.tensor does."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)
