"""Proposers: cheap guesses of a sequence's next tokens, verified afterwards by the target
(kvserve.spec.rejection).

Every proposer implements `Proposer`. The engine calls `propose_batch` once per step with the
sequences it wants to speculate for; the default loops over `propose`, which suits proposers without
a model. A draft-model proposer (its own file, e.g. spec/draft.py) subclasses `Proposer`, overrides
`propose_batch` to run one batched draft forward per drafted position, and returns `probs` (the q it
sampled from, after the request's temperature/top-k/top-p) so sampled verification stays exact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor


@dataclass(frozen=True)
class Proposal:
    """Up to k draft tokens for one sequence.

    Invariant: probs is None (each draft is a point mass on its token; see verify_sampled) or has
    shape [len(tokens), V], row i being the distribution tokens[i] was drawn from.
    """

    tokens: list[int]
    probs: Tensor | None = None


class Proposer(ABC):
    @abstractmethod
    def propose(self, token_ids: Sequence[int], num_tokens: int) -> Proposal:
        """Propose 0..num_tokens tokens to follow token_ids (the sequence's prompt + output; a list
        or a 1-D integer numpy array)."""

    def propose_batch(self, batch: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> list[Proposal]:
        """One proposal per sequence; num_tokens[i] caps sequence i's."""
        return [self.propose(ids, k) for ids, k in zip(batch, num_tokens, strict=True)]


class NgramProposer(Proposer):
    """Prompt lookup: find the longest n in [min_n, max_n] such that the sequence's last n tokens
    occurred earlier in it (occurrences may overlap the suffix), take the most recent such
    occurrence, and propose the up-to-num_tokens tokens that followed it.

    Cost: O(len * max_n) vectorized compares, with an early exit once no occurrence of the current
    length survives; a Python list first costs a conversion that can exceed the search itself, so
    callers keeping ids in an array should pass it directly
    (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> Proposal:
        ids = np.asarray(token_ids, dtype=np.int64)
        length = len(ids)
        if num_tokens <= 0 or length < 2:
            return Proposal(tokens=[])
        # match[e]: the last n tokens also end at position e (e <= length-2, so that an occurrence is
        # not the suffix itself and at least one token follows it). Grown one n at a time: an
        # occurrence of length n is one of length n-1 whose preceding token matches too.
        match = ids[:-1] == ids[-1]
        best_end = -1
        for n in range(1, min(self.max_n, length - 1) + 1):
            if n > 1:
                match[: n - 1] = False  # an occurrence of length n cannot end before position n-1
                match[n - 1 :] &= ids[: length - n] == ids[length - n]
            ends = np.flatnonzero(match)
            if len(ends) == 0:
                break
            if n >= self.min_n:
                best_end = int(ends[-1])  # longest n so far, most recent occurrence
        if best_end < 0:
            return Proposal(tokens=[])
        return Proposal(tokens=ids[best_end + 1 : best_end + 1 + num_tokens].tolist())
