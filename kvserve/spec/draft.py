"""Draft-model proposer: a smaller model drafts k tokens per sequence, one batched pass per position.

Two flavours share this code:
- self-draft: the target's first L layers plus its final norm and head. Its K/V for layers < L are
  exactly the target's (same weights, same inputs), so it reads and writes the target's own paged
  cache and needs no catch-up: the target's pass rewrites those positions identically.
- a separate draft model (same tokenizer) with its own paged KV cache addressed by the *same* block
  ids as the target's, kept in step by running it over every span the target runs (`observe`).
Draft tokens are sampled with the request's own policy and generator; their distributions q are
returned so sampled verification stays exact (spec/rejection.py).
"""

from __future__ import annotations

import torch

from kvserve.engine.runner import ModelRunner, Span
from kvserve.engine.sampler import policy_probs
from kvserve.engine.sequence import Sequence
from kvserve.spec.proposers import Proposal


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_layers: int | None, mirrors_target: bool) -> None:
        self.runner = runner
        self.num_layers = num_layers
        # True for a separate model whose cache must follow every target forward pass.
        self.mirrors_target = mirrors_target

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply the target's copy-on-write block copies to a mirrored cache too."""
        if self.mirrors_target:
            self.runner.cache.copy_blocks(copies)

    def observe(self, spans: list[Span]) -> None:
        """Compute the draft's K/V for everything the target just computed (mirrored cache only)."""
        if self.mirrors_target:
            self.runner.execute([Span(s.tokens, s.start, s.block_table, 0, s.decoding) for s in spans])

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] draft tokens for each sequence, whose blocks already cover the drafted positions."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > step]
            spans = []
            for i in active:
                seq = seqs[i]
                start = seq.num_tokens - 1 + step  # the last accepted token, then each new draft
                feed = seq.token_ids[-1] if step == 0 else tokens[i][-1]
                spans.append(Span([feed], start, seq.block_table, 1, decoding=True))
            logits = self.runner.execute(spans, num_layers=self.num_layers)
            q = policy_probs(logits, [seqs[i].params for i in active])
            for row, i in enumerate(active):
                seq = seqs[i]
                if seq.params.greedy:
                    token = int(q[row].argmax())
                else:
                    token = int(torch.multinomial(q[row].cpu(), 1, generator=seq.generator).item())
                tokens[i].append(token)
                probs[i].append(q[row])
        return [
            Proposal(t, torch.stack(p) if p else None) if t else Proposal([], None)
            for t, p in zip(tokens, probs, strict=True)
        ]
