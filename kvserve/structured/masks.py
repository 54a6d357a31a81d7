"""Token masks of a batch's constrained rows, computed together by llguidance's thread pool (started
while the forward pass runs), applied as -inf to the logits of every token the row's grammar does not
allow next."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import llguidance
import llguidance.torch as llt
import torch


@cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


@cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar-masks")


def compute_masks(matchers: list[llguidance.LLMatcher], vocab: int) -> torch.Tensor:
    """[len(matchers), vocab] bool: the tokens each matcher allows next."""
    bitmask = llt.allocate_token_bitmask(len(matchers), vocab)
    llt.fill_next_token_bitmask_par(_executor(), [(m, i) for i, m in enumerate(matchers)], bitmask)
    return allowed_tokens(bitmask, vocab)


def start_masks(matchers: dict[int, llguidance.LLMatcher], vocab: int) -> Future[dict[int, torch.Tensor]]:
    """compute_masks on a worker thread, keyed like `matchers`: the engine starts it before the forward
    pass (a mask depends only on the tokens already accepted) and collects it after. The matchers must
    not be touched until the result is in."""
    keys, values = list(matchers), list(matchers.values())
    return _worker().submit(lambda: dict(zip(keys, compute_masks(values, vocab), strict=True)))


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple[int, torch.Tensor]]) -> None:
    """logits: [R, V] float32, changed in place; rows: (row index, the tokens allowed there)."""
    if not rows:
        return
    index = torch.tensor([row for row, _ in rows], device=logits.device)
    allowed = torch.stack([mask for _, mask in rows]).to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def mask_draft_rows(logits: torch.Tensor, matcher: llguidance.LLMatcher, drafts: list[int]) -> torch.Tensor:
    """logits: [k+1, V] target rows for the last token and each of k drafts. Returns a float32 copy with
    row i masked by the grammar state after drafts[:i] (the matcher itself is left where it was). Rows
    after the first draft the grammar rejects keep whatever llguidance wrote (all allowed)."""
    vocab = logits.shape[1]
    bitmask = llt.allocate_token_bitmask(logits.shape[0], vocab)
    llt.fill_next_token_bitmask_par_with_draft_tokens(_executor(), [(matcher, 0, list(drafts))], bitmask)
    allowed = allowed_tokens(bitmask, vocab).to(logits.device)
    return logits.float().masked_fill(~allowed, float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit j of word w = token 32w + j) -> [rows, vocab] bool; a token past
    the mask's width (a model vocabulary wider than the tokenizer's) is never allowed."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if unpacked.shape[1] >= vocab:
        return unpacked[:, :vocab]
    return torch.nn.functional.pad(unpacked, (0, vocab - unpacked.shape[1]), value=False)
