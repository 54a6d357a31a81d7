"""Speculative decoding inside the engine: plan k per step, propose, verify, and keep statistics.

When it pays (book §31.5): proposing and verifying k extra tokens per sequence costs target work;
it pays only while enough drafts are accepted. Each step we pick the k (0 = no speculation) that
maximizes expected tokens per unit of step time, from
- the measured acceptance rate alpha (exponential moving average over verified drafts): a step with
  k drafts emits (1 - alpha^(k+1)) / (1 - alpha) tokens per sequence in expectation;
- a linear model of forward time in batch tokens, time(T) = a + b*T, fitted online from the
  engine's own steps, plus the proposer's own cost.
Large batches make b*T dominate, so speculation switches itself off there; small batches on a
memory-bound device make extra tokens almost free, so it runs with the full k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.sampler import greedy_tokens, policy_probs
from kvserve.engine.sequence import Sequence
from kvserve.spec.proposers import NgramProposer, Proposal
from kvserve.spec.rejection import verify_greedy, verify_sampled
from kvserve.structured.masks import mask_draft_rows

_EMA = 0.05


@dataclass
class SpecStats:
    steps: int = 0  # steps that verified at least one draft
    skipped_steps: int = 0  # decode steps where the cost model chose k = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted by verifying sequences (accepted + corrections/bonus)
    verifications: int = 0  # (sequence, step) pairs verified
    proposed_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.emitted / self.verifications if self.verifications else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec_steps": self.steps,
            "spec_skipped_steps": self.skipped_steps,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_tokens_per_step": self.mean_tokens_per_step,
            "spec_acceptance_by_position": [
                a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)
            ],
        }


class StepTimeModel:
    """time(T) = a + b*T by exponentially weighted least squares over (batch tokens, seconds)."""

    def __init__(self) -> None:
        self.n = self.st = self.sy = self.stt = self.sty = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        decay = 1 - _EMA
        self.n = self.n * decay + 1
        self.st = self.st * decay + tokens
        self.sy = self.sy * decay + seconds
        self.stt = self.stt * decay + tokens * tokens
        self.sty = self.sty * decay + tokens * seconds

    def coefficients(self) -> tuple[float, float] | None:
        var = self.n * self.stt - self.st * self.st
        if self.n < 8 or var <= 1e-9 * max(self.n * self.stt, 1.0):
            return None  # not enough spread in batch sizes yet to separate a from b
        b = max((self.n * self.sty - self.st * self.sy) / var, 0.0)
        a = max((self.sy - b * self.st) / self.n, 0.0)
        return a, b


class Speculator:
    def __init__(self, config: dict[str, Any], draft: Any | None) -> None:
        method = config.get("method")
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative.method must be 'ngram' or 'draft', got {method!r}")
        self.max_k = int(config.get("num_tokens", 4 if method == "ngram" else 3))
        if not 1 <= self.max_k <= 16:
            raise ValueError(f"speculative.num_tokens must be in [1, 16], got {self.max_k}")
        self.adaptive = bool(config.get("adaptive", True))
        self.method = method
        self.ngram = None
        if method == "ngram":
            self.ngram = NgramProposer(int(config.get("ngram_min", 1)), int(config.get("ngram_max", 4)))
        self.draft = draft
        self.alpha = 0.7  # optimistic prior so speculation is tried and measured
        self.times = StepTimeModel()
        self.stats = SpecStats(proposed_at=[0] * self.max_k, accepted_at=[0] * self.max_k)

    # ---- planning ----
    def plan_k(self, num_decoding: int, num_other_tokens: int) -> int:
        if not self.adaptive:
            return self.max_k
        coeffs = self.times.coefficients()
        if coeffs is None:
            return self.max_k
        a, b = coeffs
        base = a + b * (num_decoding + num_other_tokens)
        draft_cost = self.draft.relative_cost if self.draft is not None else 0.0
        best_k, best_rate = 0, 1.0 / base if base > 0 else 0.0
        alpha = min(self.alpha, 0.999)
        for k in range(1, self.max_k + 1):
            expected = (1 - alpha ** (k + 1)) / (1 - alpha)
            cost = base + b * num_decoding * k + k * draft_cost * (a + b * num_decoding)
            rate = expected / cost if cost > 0 else 0.0
            if rate > best_rate * 1.02:  # demand a clear gain, not noise
                best_k, best_rate = k, rate
        return best_k

    def propose(self, seqs: list[Sequence], k: int) -> list[Proposal]:
        ks = [min(k, s.params.max_tokens - s.num_output_tokens - 1) for s in seqs]
        if self.ngram is not None:
            return [
                self.ngram.propose(s.token_ids, kk) if kk > 0 else Proposal([]) for s, kk in zip(seqs, ks, strict=True)
            ]
        assert self.draft is not None  # a speculator has an n-gram proposer or a draft model
        return self.draft.propose(seqs, ks)

    # ---- verification ----
    def verify(self, seq: Sequence, draft: Proposal, target_logits: torch.Tensor) -> list[int]:
        """Tokens to emit (1..k+1) given target logits for the last token and each scheduled draft.

        The scheduler may have cut the drafts short to fit its token budget: only the first k =
        rows - 1 drafts were fed to the target, so only they are verified (and counted).
        """
        k = target_logits.shape[0] - 1
        draft = Proposal(draft.tokens[:k], draft.probs[:k] if draft.probs is not None else None)
        if seq.matcher is not None:
            # Row i is masked by the grammar after drafts[:i]: a draft the grammar forbids has target
            # probability 0 and is rejected, so rows past it (masked arbitrarily) are never reached.
            target_logits = mask_draft_rows(target_logits, seq.matcher, draft.tokens)
        if seq.params.greedy:
            emitted = verify_greedy(draft.tokens, greedy_tokens(target_logits).tolist())
        else:
            p = policy_probs(target_logits, [seq.params] * target_logits.shape[0])
            emitted = verify_sampled(draft.tokens, draft.probs, p, seq.generator)
        accepted = len(emitted) - 1
        stats = self.stats
        stats.proposed += len(draft.tokens)
        stats.accepted += accepted
        stats.emitted += len(emitted)
        stats.verifications += 1
        for position in range(len(draft.tokens)):
            stats.proposed_at[position] += 1
            stats.accepted_at[position] += int(position < accepted)
        if draft.tokens:
            self.alpha = (1 - _EMA) * self.alpha + _EMA * (accepted / len(draft.tokens))
        return emitted
