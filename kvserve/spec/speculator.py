"""Speculative decoding inside the engine: what it does each step, and its statistics.

The engine makes these calls per step (kvserve/engine/engine.py, `step`):
1. `plan(running)` before scheduling: the planner (spec/planner.py) picks k; each chosen decoding
   sequence gets its drafts in `seq.spec_tokens`: n-gram drafts at once, or k placeholder slots for a
   draft model, filled after scheduling once blocks for the drafted positions are reserved. The
   scheduler may cut them short to fit its token budget.
2. `draft(sched)` after scheduling: a mirrored draft cache applies the step's block copies, draft
   slots are filled (each scheduled item shrunk to what was drafted), and the target pass is timed
   from here;
3. `observe(spans, batch_tokens)` after the target pass: its time goes to the planner, and a
   mirrored draft model computes its K/V for the same spans;
4. `verify(seq, logits)` for every sequence the target ran with drafts.
Invariant: a sequence has spec_tokens only between `plan` and its verification (or its preemption);
`plan` clears those of a step that did not schedule it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.runner import Span
from kvserve.engine.sampler import greedy_tokens, policy_probs
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.spec.draft import DraftModelProposer
from kvserve.spec.planner import SpeculationPlanner
from kvserve.spec.proposers import NgramProposer, Proposal
from kvserve.spec.rejection import verify_greedy, verify_sampled
from kvserve.structured.masks import mask_draft_rows

# Placeholder for a draft-model token not drafted yet; replaced before the forward pass reads it.
_DRAFT_SLOT = -1


@dataclass
class SpecStats:
    steps: int = 0  # steps that verified at least one draft
    skipped_steps: int = 0  # decode steps where the cost model chose k = 0
    probe_steps: int = 0  # steps that drafted for one sequence only, to keep acceptance measured
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
            "spec_probe_steps": self.probe_steps,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_tokens_per_step": self.mean_tokens_per_step,
            "spec_acceptance_by_position": [
                a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)
            ],
        }


class Speculator:
    def __init__(self, config: dict[str, Any], draft: DraftModelProposer | None) -> None:
        method = config.get("method")
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative.method must be 'ngram' or 'draft', got {method!r}")
        self.max_k = int(config.get("num_tokens", 4 if method == "ngram" else 3))
        if not 1 <= self.max_k <= 16:
            raise ValueError(f"speculative.num_tokens must be in [1, 16], got {self.max_k}")
        self.method = method
        self.ngram = None
        if method == "ngram":
            self.ngram = NgramProposer(int(config.get("ngram_min", 1)), int(config.get("ngram_max", 4)))
        self.draft_model = draft
        # A draft model runs one pass per drafted position, n-gram lookup one per step.
        self.planner = SpeculationPlanner(self.max_k, bool(config.get("adaptive", True)), draft is not None)
        self.stats = SpecStats(proposed_at=[0] * self.max_k, accepted_at=[0] * self.max_k)
        self._proposals: dict[int, Proposal] = {}  # seq_id -> this step's drafts
        self._asked: dict[int, int] = {}  # seq_id -> drafts the plan asked for this step
        self._target_started: float | None = None
        self._verifies = False  # whether the step being timed verifies drafts
        self._probes = 0

    # ---- before scheduling ----
    def plan(self, running: list[Sequence]) -> None:
        """Choose k for this step and give the chosen decoding sequences their drafts or draft slots."""
        self._proposals = {}
        self._asked = {}
        decoding: list[Sequence] = []
        prefill_tokens = 0
        for seq in running:
            if seq.in_prefill:
                prefill_tokens += seq.num_tokens - seq.num_computed_tokens
                continue
            seq.spec_tokens = []
            # A sequence's first token is never speculated: an n > 1 request forks its samples there.
            if seq.num_output_tokens > 0 and seq.params.speculates and _room(seq) > 0:
                decoding.append(seq)
        if not decoding:
            return
        plan = self.planner.plan(len(decoding), prefill_tokens)
        if plan.k == 0:
            self.stats.skipped_steps += 1
            return
        if plan.probe:
            decoding = [decoding[self._probes % len(decoding)]]  # rotates over the batch
            self._probes += 1
            self.stats.probe_steps += 1
        ks = [min(plan.k, _room(seq)) for seq in decoding]
        self._asked = {seq.seq_id: k for seq, k in zip(decoding, ks, strict=True)}
        if self.draft_model is not None:
            for seq, k in zip(decoding, ks, strict=True):
                seq.spec_tokens = [_DRAFT_SLOT] * k
            return
        for seq, proposal in zip(decoding, self._propose(decoding, ks), strict=True):
            seq.spec_tokens = list(proposal.tokens)
            self._keep(seq, proposal)

    # ---- after scheduling, around the target pass ----
    def draft(self, sched: SchedulerOutput) -> None:
        """Fill the draft-model slots of scheduled sequences; shrink each item to what was drafted."""
        if self.draft_model is not None:
            self.draft_model.copy_blocks(sched.block_copies)  # before drafting: it reads the copied blocks
            items = [item for item in sched.scheduled if item.seq.spec_tokens]
            if items:
                seqs = [item.seq for item in items]
                drafted = self._propose(seqs, [len(s.spec_tokens) for s in seqs])
                for item, proposal in zip(items, drafted, strict=True):
                    item.seq.spec_tokens = list(proposal.tokens)
                    item.num_new_tokens = item.num_logits = 1 + len(proposal.tokens)
                    self._keep(item.seq, proposal)
        self._verifies = any(item.seq.spec_tokens for item in sched.scheduled)
        self._target_started = time.perf_counter()

    def observe(self, spans: list[Span], batch_tokens: int) -> None:
        """After the target pass over `spans` (batch_tokens in all): time it; a mirrored draft follows it."""
        if self._target_started is not None:
            seconds = time.perf_counter() - self._target_started
            self.planner.observe_target(batch_tokens, seconds, self._verifies)
            self._target_started = None
        if self.draft_model is not None:
            self.draft_model.observe(spans)

    def _keep(self, seq: Sequence, proposal: Proposal) -> None:
        """Hold a sequence's drafts until its verification; one with none is never verified, so the
        planner hears now that none of the drafts asked for came."""
        if proposal.tokens:
            self._proposals[seq.seq_id] = proposal
        else:
            self.planner.observe_verification(self._asked[seq.seq_id], 0, 0)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Drafts from the proposer, timed for the planner."""
        began = time.perf_counter()
        if self.ngram is not None:
            proposals = [self.ngram.propose(s.token_ids, k) for s, k in zip(seqs, ks, strict=True)]
            passes = 1
        else:
            assert self.draft_model is not None  # a speculator has an n-gram proposer or a draft model
            proposals = self.draft_model.propose(seqs, ks)
            passes = max(ks, default=0)
        self.planner.observe_proposer(len(seqs), passes, time.perf_counter() - began)
        return proposals

    # ---- verification ----
    def verify(self, seq: Sequence, target_logits: torch.Tensor) -> list[int]:
        """Tokens to emit (1..k+1) given target logits for the last token and each scheduled draft.

        The scheduler may have cut the drafts short to fit its token budget: only the first k =
        rows - 1 drafts were fed to the target, so only they are verified (and counted).
        """
        k = target_logits.shape[0] - 1
        draft = self._proposals.pop(seq.seq_id)
        # Drafts the scheduler cut were not the proposer's to give: ask for no more than were fed.
        asked = k if k < len(draft.tokens) else self._asked[seq.seq_id]
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
        self.planner.observe_verification(asked, len(draft.tokens), accepted)
        return emitted


def _room(seq: Sequence) -> int:
    """Drafts that fit before max_tokens, keeping room for the token the target adds after them."""
    return seq.params.max_tokens - seq.num_output_tokens - 1
