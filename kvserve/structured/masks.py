"""Token masks of a batch's constrained rows, computed together by llguidance's thread pool (started
while the forward pass runs), applied as -inf to the logits of every token the row's grammar does not
allow next.

A mask stays in llguidance's packed form (int32 words, bit j of word w = token 32w + j) until it is
applied; it is then added to the logits as a row of 0 / -inf looked up a byte at a time (one gather and
one add: masked_fill over bool rows costs several times more; RESULTS.md, "Figures behind the code's
rules", masks.py).
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import llguidance
import llguidance.numpy as llnp
import torch


@cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def _new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """[rows, words] int32, every token allowed. (llguidance.torch's helpers are not used: importing that
    module compiles a kernel with torch.compile, which loads torch's compiler stack, ~115 MiB of RSS in
    every server process; its numpy helpers write into the same memory.)"""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


@cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar-masks")


# Read as bytes, word w's byte b holds tokens 32w + 8b .. 32w + 8b + 7 only where words are little-endian.
assert sys.byteorder == "little", "grammar masks are read as little-endian int32 words"


@cache
def _penalty_of_byte() -> torch.Tensor:
    """Row v: the additive mask of the 8 tokens of a mask byte of value v (bit k set: token k allowed, 0).
    Built on first use, not at import: a forced CPU path (kernels/cpu/isa.py) must cap torch's ops
    before any of them runs."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf"))


def compute_masks(matchers: list[llguidance.LLMatcher], vocab: int) -> torch.Tensor:
    """[len(matchers), words] int32 packed masks: the tokens each matcher allows next."""
    bitmask = _new_bitmask(len(matchers), vocab)
    llnp.fill_next_token_bitmask_par(_executor(), [(m, i) for i, m in enumerate(matchers)], bitmask.numpy())
    return bitmask


def start_masks(matchers: dict[int, llguidance.LLMatcher], vocab: int) -> Future[dict[int, torch.Tensor]]:
    """compute_masks on a worker thread, keyed like `matchers`: the engine starts it before the forward
    pass (a mask depends only on the tokens already accepted) and collects it after. The matchers must
    not be touched until the result is in."""
    keys, values = list(matchers), list(matchers.values())
    return _worker().submit(lambda: dict(zip(keys, compute_masks(values, vocab), strict=True)))


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple[int, torch.Tensor]]) -> None:
    """logits: [R, V] float32 (finite or -inf), changed in place; rows: (row index, its packed mask)."""
    if not rows:
        return
    index = torch.tensor([row for row, _ in rows], device=logits.device)
    penalties = grammar_penalties(torch.stack([mask for _, mask in rows]), logits.shape[1])
    logits.index_add_(0, index, penalties.to(logits.device))


def mask_draft_rows(logits: torch.Tensor, matcher: llguidance.LLMatcher, drafts: list[int]) -> torch.Tensor:
    """logits: [k+1, V] target rows for the last token and each of k drafts. Returns a float32 copy with
    row i masked by the grammar state after drafts[:i] (the matcher itself is left where it was). Rows
    after the first draft the grammar rejects keep whatever llguidance wrote (all allowed)."""
    vocab = logits.shape[1]
    bitmask = _new_bitmask(logits.shape[0], vocab)
    llnp.fill_next_token_bitmask_par_with_draft_tokens(_executor(), [(matcher, 0, list(drafts))], bitmask.numpy())
    return logits.float() + grammar_penalties(bitmask, vocab).to(logits.device)


def grammar_penalties(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 packed masks -> [rows, vocab] float32, 0 where a token is allowed and -inf where
    not; a token past the mask's width (a model vocabulary wider than the tokenizer's) is never allowed."""
    mask_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    penalties = _penalty_of_byte().index_select(0, mask_bytes).reshape(bitmask.shape[0], -1)
    if penalties.shape[1] >= vocab:
        return penalties[:, :vocab]
    return torch.nn.functional.pad(penalties, (0, vocab - penalties.shape[1]), value=float("-inf"))
