"""Speculative verification is exact: book Example 31.3, exercise 3, an analytic test of one
accept/reject step, and a seeded Monte Carlo chi-square test of the sampling path."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch import Tensor

from kvserve.spec.rejection import (
    acceptance_probability,
    output_distribution_one_step,
    residual_distribution,
    verify_greedy,
    verify_sampled,
)

F64 = torch.float64


def t(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=F64)


def wrong_resample_from_p(p: Tensor, q: Tensor) -> Tensor:
    """The mistake Example 31.3 warns about: on rejection, resample from p instead of the residual."""
    accept = acceptance_probability(p, q, torch.arange(len(p)))
    return q * accept + (q * (1 - accept)).sum() * p


@pytest.mark.parametrize(
    ("p", "q", "acceptance", "residual"),
    [
        ([0.6, 0.4], [0.8, 0.2], [0.75, 1.0], [0.0, 1.0]),  # Example 31.3 (Paris, Lyon)
        ([0.3, 0.7], [0.6, 0.4], [0.5, 1.0], [0.0, 1.0]),  # exercise 3
    ],
)
def test_book_examples(p: list[float], q: list[float], acceptance: list[float], residual: list[float]) -> None:
    pt, qt = t(p), t(q)
    assert torch.allclose(acceptance_probability(pt, qt, torch.arange(2)), t(acceptance))
    assert acceptance_probability(pt, qt, 0).item() == pytest.approx(acceptance[0])
    assert torch.allclose(residual_distribution(pt, qt), t(residual))
    assert torch.allclose(output_distribution_one_step(pt, qt), pt, atol=1e-12)


def test_example_31_3_wrong_variant_gives_paris_072() -> None:
    wrong = wrong_resample_from_p(t([0.6, 0.4]), t([0.8, 0.2]))
    assert wrong[0].item() == pytest.approx(0.72)


def random_pairs(gen: torch.Generator, vocab: int) -> list[tuple[Tensor, Tensor]]:
    def dirichlet() -> Tensor:  # Dirichlet(1, ..., 1): normalized Exp(1) draws
        e = -torch.rand(vocab, generator=gen, dtype=F64).log()
        return e / e.sum()

    def with_zeros(d: Tensor) -> Tensor:
        d = d * (torch.rand(vocab, generator=gen, dtype=F64) < 0.5)
        d[torch.randint(vocab, (1,), generator=gen)] += 0.1  # keep some mass
        return d / d.sum()

    p, q = dirichlet(), dirichlet()
    half = vocab // 2
    disjoint_p = torch.cat([dirichlet()[:half], torch.zeros(vocab - half, dtype=F64)])
    disjoint_q = torch.cat([torch.zeros(half, dtype=F64), dirichlet()[half:]])
    point = torch.zeros(vocab, dtype=F64)
    point[1] = 1.0
    return [
        (p, q),
        (p, p.clone()),  # residual all zero: never sampled, must not produce NaN
        (disjoint_p / disjoint_p.sum(), disjoint_q / disjoint_q.sum()),
        (with_zeros(p), q),
        (p, with_zeros(q)),
        (with_zeros(p), with_zeros(q)),
        (p, point),  # n-gram style point-mass proposal
        (point, point),
    ]


def test_one_step_output_equals_target_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (2, 3, 7, 50):
        for _ in range(20):
            for p, q in random_pairs(gen, vocab):
                out = output_distribution_one_step(p, q)
                assert not out.isnan().any()
                assert torch.allclose(out, p, rtol=0, atol=1e-9), (p, q, out)
    # batched form: a [positions, V] stack at once
    pairs = random_pairs(gen, 6)
    ps, qs = torch.stack([p for p, _ in pairs]), torch.stack([q for _, q in pairs])
    assert torch.allclose(output_distribution_one_step(ps, qs), ps, rtol=0, atol=1e-9)


def test_residual_all_zero_is_defined() -> None:
    p = t([0.25, 0.75])
    assert torch.equal(residual_distribution(p, p), p)
    point = t([0.0, 1.0])
    assert torch.equal(residual_distribution(point, point), point)


def test_acceptance_batched_and_conventions() -> None:
    p = t([[0.6, 0.4, 0.0], [0.0, 0.5, 0.5]])
    q = t([[0.8, 0.0, 0.2], [0.0, 1.0, 0.0]])
    assert torch.allclose(acceptance_probability(p, q, torch.tensor([0, 1])), t([0.75, 0.5]))
    # p(x) = 0: never accept, whatever q; q(x) = 0 < p(x): accept.
    assert torch.equal(acceptance_probability(p, q, torch.tensor([2, 0])), t([0.0, 0.0]))
    assert acceptance_probability(p[0], q[0], 1).item() == 1.0
    with pytest.raises(ValueError):
        acceptance_probability(p, q, torch.tensor([0, 1, 2]))


def test_point_mass_verify_is_exact() -> None:
    """verify_sampled with draft_probs=None against the one-step analytic rule for point masses:
    emitting x (accepted) w.p. p(x), otherwise sampling p with x zeroed, gives p exactly."""
    p = t([0.1, 0.2, 0.3, 0.4])
    for x in range(4):
        point = torch.zeros(4, dtype=F64)
        point[x] = 1.0
        assert torch.allclose(output_distribution_one_step(p, point), p, atol=1e-12)
        residual = residual_distribution(p, point)
        assert residual[x] == 0 and torch.allclose(residual.sum(), t([1.0]))
    # draft token with p(x) = 1: always accepted; p(x) = 0: always replaced.
    target = t([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        out = verify_sampled([1, 0], None, target, gen)
        assert out[0] == 1 and out[1] in (2, 3) and len(out) == 2


def test_verify_greedy() -> None:
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch corrected, then stop
    assert verify_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert verify_greedy([], [4]) == [4]  # k = 0 is plain greedy decoding
    with pytest.raises(ValueError):
        verify_greedy([5], [5])


def test_verify_sampled_is_reproducible_per_seed() -> None:
    target = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(2)), -1)
    draft = torch.softmax(torch.randn(3, 9, generator=torch.Generator().manual_seed(3)), -1)
    runs = [
        [verify_sampled([1, 2, 3], draft, target, torch.Generator().manual_seed(s)) for s in range(30)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1
    with pytest.raises(ValueError):
        verify_sampled([1, 2], draft, target)


# --- Monte Carlo: speculation reproduces autoregressive sampling from the target -------------------
#
# Target and draft distributions depend on the absolute position only (not on history), so sampling
# from the target alone gives independent tokens, token t ~ P[t]. We generate sequences of length
# LENGTH by repeated speculate-and-verify steps, each drafting K tokens, and check the joint
# distribution of the whole sequence against prod_t P[t] with a chi-square test. This covers the
# first token, the acceptance chain, the residual, the bonus token, and chaining of steps.
# 60k sequences take about 1.1e5 k=3 verifications (~1.8 per sequence); the seeds are fixed, and a
# wrong residual (resample from p) or a bonus drawn from the wrong row fails with p-value ~0.

K = 3
LENGTH = 4
VOCAB = 5
POSITIONS = LENGTH + K  # a step starting at position LENGTH-1 reads targets up to LENGTH-1+K


def position_tables() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1234)
    target = torch.softmax(torch.randn(POSITIONS, VOCAB, generator=gen, dtype=F64), -1)
    # a draft close enough to the target that the chain often runs to the bonus token
    draft = 0.7 * target + 0.3 * torch.softmax(2 * torch.randn(POSITIONS, VOCAB, generator=gen, dtype=F64), -1)
    target[1, 4] = 0.0  # drafts of token 4 at position 1 are always rejected
    target /= target.sum(-1, keepdim=True)
    draft[2, :2] = 0.0  # the target's mass on tokens 0, 1 at position 2 comes only from the residual
    draft /= draft.sum(-1, keepdim=True)
    draft[3] = target[3]  # q == p: never rejected, residual all zero
    return target, draft


def chi_square_p_value(counts: Counter[tuple[int, ...]], probs: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson chi-square p-value; cells expecting < 5 are pooled. Zero-probability cells must be
    empty."""
    assert all(probs.get(cell, 0.0) > 0 for cell in counts), "emitted a sequence of probability 0"
    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for cell, prob in probs.items():
        if n * prob >= 5:
            observed.append(counts[cell])
            expected.append(n * prob)
        else:
            pooled_obs += counts[cell]
            pooled_exp += n * prob
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    obs, exp = torch.tensor(observed, dtype=F64), torch.tensor(expected, dtype=F64)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((len(observed) - 1) / 2, dtype=F64)
    return torch.special.gammaincc(df, stat / 2).item()  # chi2 survival function


def autoregressive_probs(target: Tensor) -> dict[tuple[int, ...], float]:
    rows = target[:LENGTH].tolist()
    return {
        seq: float(torch.tensor([rows[i][tok] for i, tok in enumerate(seq)], dtype=F64).prod())
        for seq in itertools.product(range(VOCAB), repeat=LENGTH)
    }


def simulate(target: Tensor, draft: Tensor | None, sequences: int, seed: int) -> Counter[tuple[int, ...]]:
    """draft=None: a deterministic point-mass proposer that drafts the target's mode."""
    gen = torch.Generator().manual_seed(seed)
    targets = [target[s : s + K + 1].contiguous() for s in range(LENGTH)]
    if draft is None:
        drafts = [None] * LENGTH
        modes = target.argmax(-1).tolist()
        fixed = [modes[s : s + K] for s in range(LENGTH)]
    else:
        drafts = [draft[s : s + K].contiguous() for s in range(LENGTH)]
        # Drafting from q, presampled in bulk: position p's draws are consumed in order, each once;
        # a sequence drafts a position at most K times (once per step whose window covers it).
        pools = [
            iter(torch.multinomial(draft[p], K * sequences, True, generator=gen).tolist()) for p in range(POSITIONS)
        ]
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(sequences):
        seq: list[int] = []
        while len(seq) < LENGTH:
            start = len(seq)
            tokens = fixed[start] if draft is None else [next(pools[p]) for p in range(start, start + K)]
            seq += verify_sampled(tokens, drafts[start], targets[start], gen)
        counts[tuple(seq[:LENGTH])] += 1
    return counts


@pytest.mark.parametrize(("proposer", "sequences"), [("draft", 60_000), ("point_mass", 10_000)])
def test_monte_carlo_chi_square(proposer: str, sequences: int) -> None:
    target, draft = position_tables()
    counts = simulate(target, draft if proposer == "draft" else None, sequences, seed=7)
    assert sum(counts.values()) == sequences
    joint = autoregressive_probs(target)
    assert chi_square_p_value(counts, joint, sequences) > 1e-3
    for pos in range(LENGTH):  # each position's marginal, for a clearer failure
        marginal: Counter[tuple[int, ...]] = Counter()
        for seq, c in counts.items():
            marginal[(seq[pos],)] += c
        probs = {(tok,): target[pos, tok].item() for tok in range(VOCAB)}
        assert chi_square_p_value(marginal, probs, sequences) > 1e-3, pos
