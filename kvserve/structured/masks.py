"""Token masks of a batch's constrained rows, computed together by llguidance's thread pool, applied
as -inf to the logits of every token the row's grammar does not allow next."""

from __future__ import annotations

from functools import cache

import llguidance
import llguidance.torch as llt
import torch


@cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple[int, llguidance.LLMatcher]]) -> None:
    """logits: [R, V] float32, changed in place; rows: (row index, that row's matcher)."""
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = llt.allocate_token_bitmask(len(rows), vocab)
    llt.fill_next_token_bitmask_par(_executor(), [(m, i) for i, (_, m) in enumerate(rows)], bitmask)
    allowed = allowed_tokens(bitmask, vocab).to(logits.device)
    index = torch.tensor([row for row, _ in rows], device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit j of word w = token 32w + j) -> [rows, vocab] bool; a token past
    the mask's width (a model vocabulary wider than the tokenizer's) is never allowed."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if unpacked.shape[1] >= vocab:
        return unpacked[:, :vocab]
    return torch.nn.functional.pad(unpacked, (0, vocab - unpacked.shape[1]), value=False)
