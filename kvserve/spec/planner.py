"""How many tokens to draft this step (book §31.5): speculate only where the measured costs say it pays.

Proposing and verifying k drafts per sequence costs time; it pays only while enough drafts are
accepted. Each decode step the planner compares expected tokens per second with k drafts against
k = 0, from three online estimates:
- the acceptance rate alpha (`RunLengthEstimate`): the chance that the next of the k drafts asked
  for is proposed and accepted, after all before it were; a step with k drafts emits
  (1 - alpha^(k+1)) / (1 - alpha) tokens per sequence in expectation. A proposer may propose fewer
  than k (an n-gram match that runs out, or none at all): a draft missing is counted as a rejected
  one, since either ends the sequence's tokens there. Counting only the drafts proposed would
  promise k accepted drafts where the proposer gives two;
- the draft length beta (the same estimate over drafts proposed, accepted or not): a step asking
  for k drafts verifies beta + beta^2 + ... + beta^k of them per sequence in expectation, the
  batch tokens its target pass is timed by;
- the target's forward time in batch tokens, a + b*T (`LinearTime`), timed around the target pass
  alone, so that drafting never inflates b; fitted apart for steps without drafts and steps that
  verify drafts, since a verifying step may take another, costlier path than a plain decode step
  (several query rows per sequence) that no line through plain steps predicts;
- the proposer's own time per pass in proposing rows, c + e*n, timed around every proposal (a draft
  model runs one pass per drafted position, a model-free proposer one per step).
With no fit yet, or when k = 0 wins, nothing is drafted except a probe: one draft for one sequence,
the cheapest way to keep alpha measured (a probe's outcome replaces the evidence, which is stale by
then; a probe that found no draft, e.g. no n-gram match, counts as one rejected). Probes follow a
bounded schedule: the first decode step, then after FIRST_PROBE_GAP steps, the gap doubling after
every probe that leaves k = 0 best (up to MAX_PROBE_GAP), and reset once speculation pays on two
decisions in a row (the second made with the first's verified drafts, so that one lucky probe does
not reset it). So a proposer that never pays costs one cheap probe per doubling gap, and a k = 0
step costs the planner a few arithmetic operations.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.05  # weight of the newest observation in the time fits (about the last 20 steps count)
MIN_FIT_WEIGHT = 3.0  # decayed observations a fit needs (with spread in x) before it is trusted
FIRST_PROBE_GAP = 32
MAX_PROBE_GAP = 1024
PRIOR_RATE = 0.7  # alpha before any evidence: optimistic, so that the first probe's outcome decides
PRIOR_WEIGHT = 0.5  # in drafts: one rejected probe leaves alpha at 0.23, where drafting seldom pays; one kept, 0.9
# Steps that verified drafts: older evidence decays by 1/e over this many newer ones. Counted in steps,
# not drafts, so that the estimate spans as many steps at batch 16 as at batch 1: over a window of
# drafts, a batch of 16 fills it in one or two steps, and that noise alone starts and stops speculation.
ACCEPTANCE_WINDOW = 8
MIN_GAIN = 1.02  # speculate only for a clear predicted gain, not noise


class LinearTime:
    """seconds(x) = a + b*x by exponentially weighted least squares over (x, seconds) observations."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self._slope: float | None = None  # b of the last fit that had spread in x

    def observe(self, x: float, seconds: float) -> None:
        keep = 1 - _DECAY
        self.n = self.n * keep + 1
        self.sx = self.sx * keep + x
        self.sy = self.sy * keep + seconds
        self.sxx = self.sxx * keep + x * x
        self.sxy = self.sxy * keep + x * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None until MIN_FIT_WEIGHT observations with spread in x. When the spread has
        decayed away (a long run of equal x, e.g. decode steps without drafts), the last slope is
        kept and only a follows the recent observations."""
        if self.n < MIN_FIT_WEIGHT:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var > 1e-6 * max(self.n * self.sxx, 1e-30):
            self._slope = max((self.n * self.sxy - self.sx * self.sy) / var, 0.0)
        if self._slope is None:
            return None
        b = self._slope
        return max((self.sy - b * self.sx) / self.n, 0.0), b

    def means(self) -> tuple[float, float] | None:
        """Weighted mean (x, seconds) of the observations; None before any."""
        return (self.sx / self.n, self.sy / self.n) if self.n else None


class RunLengthEstimate:
    """The chance p that a run of positions goes on at each position, under the model the planner
    uses (each position succeeds with probability p, independently, until the first failure).

    A run that reached `succeeded` of `asked` positions observed that many successes and, if it
    stopped early, one failure; the positions after a failure were never tried. p is the posterior
    mean of those decayed counts with a prior worth PRIOR_WEIGHT trials at PRIOR_RATE.
    """

    def __init__(self) -> None:
        self.trials = 0.0
        self.successes = 0.0

    def observe(self, asked: int, succeeded: int) -> None:
        self.trials += succeeded + int(succeeded < asked)
        self.successes += succeeded

    def age(self) -> None:
        """One step's worth of decay of the evidence so far."""
        keep = 1 - 1 / ACCEPTANCE_WINDOW
        self.trials *= keep
        self.successes *= keep

    def forget(self) -> None:
        """Drop the evidence (back to the prior)."""
        self.trials = self.successes = 0.0

    @property
    def rate(self) -> float:
        return (self.successes + PRIOR_RATE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one sequence emits in a step asking for k drafts: accepted drafts plus one
    (with alpha the draft length beta: drafts proposed plus one)."""
    alpha = min(alpha, 0.999)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class Plan:
    """k drafts for every decoding sequence, or for one of them when `probe`."""

    k: int
    probe: bool = False


NO_SPECULATION = Plan(0)


class SpeculationPlanner:
    """Chooses each step's Plan. `passes_grow_with_k`: the proposer runs one pass per draft (a draft
    model) rather than one per step (n-gram lookup)."""

    def __init__(self, max_k: int, adaptive: bool, passes_grow_with_k: bool) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.passes_grow_with_k = passes_grow_with_k
        self.acceptance = RunLengthEstimate()  # drafts asked for that were proposed and accepted
        self.draft_length = RunLengthEstimate()  # drafts asked for that were proposed
        self.target_time = LinearTime()  # steps without drafts; x: batch tokens of the target pass
        self.verify_time = LinearTime()  # steps with drafts; x: batch tokens, drafts included
        self.proposer_time = LinearTime()  # x: rows per proposer pass; seconds per pass
        self._probe_gap = FIRST_PROBE_GAP
        self._steps_to_probe = 0  # the first decode step probes
        self._last_k = 0  # the previous decision's k
        self._probing = False  # the current step is a probe: its verification replaces the evidence
        self._step_observed = False  # the current step has verified drafts (its evidence is in)

    # ---- observations ----
    def observe_target(self, batch_tokens: int, seconds: float, verified_drafts: bool) -> None:
        (self.verify_time if verified_drafts else self.target_time).observe(batch_tokens, seconds)

    def observe_proposer(self, rows: int, passes: int, seconds: float) -> None:
        if passes > 0:
            self.proposer_time.observe(rows, seconds / passes)

    def observe_verification(self, asked: int, proposed: int, accepted: int) -> None:
        """One sequence's drafts this step: `asked` for, `proposed` (<= asked), `accepted` (<= proposed)."""
        if asked:
            if self._probing:  # the evidence before a probe is stale: its outcome alone decides
                self.acceptance.forget()
                self.draft_length.forget()
                self._probing = False
            elif not self._step_observed:  # the step's first verification: older steps' evidence ages
                self.acceptance.age()
                self.draft_length.age()
            self._step_observed = True
            self.acceptance.observe(asked, accepted)
            self.draft_length.observe(asked, proposed)

    # ---- the decision ----
    def plan(self, num_decoding: int, num_other_tokens: int) -> Plan:
        """num_decoding: sequences that may draft; num_other_tokens: the step's other tokens (prefill)."""
        self._probing = self._step_observed = False
        if not self.adaptive:
            return Plan(self.max_k)
        k = self.best_k(num_decoding, num_other_tokens)
        paid_before, self._last_k = self._last_k, k
        if k > 0:
            if paid_before:  # still paying after verifying the last step's drafts: not a lucky probe
                self._probe_gap = FIRST_PROBE_GAP
            self._steps_to_probe = self._probe_gap
            return Plan(k)
        if self._steps_to_probe > 0:
            self._steps_to_probe -= 1
            return NO_SPECULATION
        self._steps_to_probe = self._probe_gap
        self._probe_gap = min(2 * self._probe_gap, MAX_PROBE_GAP)
        self._probing = True
        return Plan(1, probe=True)

    def best_k(self, num_decoding: int, num_other_tokens: int) -> int:
        """The k maximizing predicted tokens per second; 0 unless it beats k = 0 by MIN_GAIN, and 0
        before the target's time is fitted and the proposer was timed."""
        target = self.target_time.coefficients()
        if target is None:
            return 0
        a, b = target
        proposer = self._proposer_seconds(num_decoding, a, b)
        if proposer is None:
            return 0
        tokens = num_decoding + num_other_tokens
        base = a + b * tokens
        if base <= 0:
            return 0
        alpha, beta = self.acceptance.rate, self.draft_length.rate
        best_k, best_rate = 0, MIN_GAIN / base  # tokens per second per sequence, k = 0 handicapped
        for k in range(1, self.max_k + 1):
            passes = k if self.passes_grow_with_k else 1
            drafts = expected_tokens(beta, k) - 1  # per sequence, proposed
            seconds = self._verify_seconds(tokens + num_decoding * drafts, a, b) + passes * proposer
            rate = expected_tokens(alpha, k) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _proposer_seconds(self, rows: int, a: float, b: float) -> float | None:
        """Predicted seconds of one proposer pass over `rows` sequences; None before any was timed.
        Until passes of different sizes give a fit (probes run one row), the mean pass is scaled
        the way the target's time scales in batch tokens, a + b*T."""
        fit = self.proposer_time.coefficients()
        if fit is not None:
            return fit[0] + fit[1] * rows
        means = self.proposer_time.means()
        if means is None:
            return None
        mean_rows, mean_seconds = means
        return mean_seconds * (a + b * rows) / max(a + b * mean_rows, 1e-12)

    def _verify_seconds(self, tokens: float, a: float, b: float) -> float:
        """Predicted seconds of a target pass verifying drafts, `tokens` in all. Until such passes of
        different sizes give a fit, their mean is scaled the way plain passes scale; before any was
        timed, a plain pass of that size (the first probe measures the difference)."""
        fit = self.verify_time.coefficients()
        if fit is not None:
            return fit[0] + fit[1] * tokens
        means = self.verify_time.means()
        if means is None:
            return a + b * tokens
        mean_tokens, mean_seconds = means
        return mean_seconds * (a + b * tokens) / max(a + b * mean_tokens, 1e-12)
