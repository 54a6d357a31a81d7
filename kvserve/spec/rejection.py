"""Verification of speculative proposals: the exact accept/reject rule (book §31.5, Example 31.3;
Leviathan et al. 2023, §2.3).

Every distribution here, the target's p and the proposal's q, must ALREADY include the request's
generation policy (temperature, top-k, top-p); applying it is the caller's job. It must be the same
policy when drafting and when verifying: the guarantee that the emitted tokens are distributed
exactly as sampling from the target alone holds for the p and q actually passed in, nothing else.

Shapes: a distribution is a tensor whose last dimension is the vocabulary V and which sums to 1 over
it; leading dimensions, if any, are a batch of positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _accept(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p_x / q_x) elementwise, computed as p_x / max(p_x, q_x): exactly 1 when p_x >= q_x
    (x / x == 1 in IEEE arithmetic), p_x / q_x otherwise, and never infinite.

    Where the ratio is undefined: q_x == 0 < p_x gives 1, and p_x == 0 gives 0 (0/0 is mapped to 0),
    so a token the target forbids (e.g. cut by its top-k) is never accepted. A token really drafted
    from q has q_x > 0, so these cases change no probability; they keep point masses and rounding
    NaN-free.
    """
    return (p_x / torch.maximum(p_x, q_x)).nan_to_num(nan=0.0)


def acceptance_probability(p: Tensor, q: Tensor, x: int | Tensor) -> Tensor:
    """Probability min(1, p(x)/q(x)) of accepting drafted token x.

    p, q: [..., V], same shape. x: an int or integer tensor of shape p.shape[:-1] (one token per
    distribution), or p.shape[:-1] + (m,) (m tokens per distribution). The result has x's shape.
    """
    if p.shape != q.shape:
        raise ValueError(f"p and q shapes differ: {tuple(p.shape)} vs {tuple(q.shape)}")
    idx = torch.as_tensor(x, dtype=torch.long, device=p.device)
    if idx.dim() == p.dim() - 1 and idx.shape == p.shape[:-1]:
        idx = idx.unsqueeze(-1)
        return _accept(p.gather(-1, idx), q.gather(-1, idx)).squeeze(-1)
    if idx.dim() == p.dim() and idx.shape[:-1] == p.shape[:-1]:
        return _accept(p.gather(-1, idx), q.gather(-1, idx))
    raise ValueError(f"token index shape {tuple(idx.shape)} does not fit distributions {tuple(p.shape)}")


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """normalize(max(p - q, 0)) over the last dimension: what to sample after a rejection.

    When the positive part is all zero (p <= q everywhere, which for normalized distributions means
    p == q), rejection has probability zero, so the residual is never sampled. We return p there
    instead of 0/0 = NaN: the result is then always a valid distribution, and P(reject) * residual is
    exactly 0 in the analytic output. (With p and q equal only up to rounding, the residual is noise
    but is reached with probability of the order of that rounding.)
    """
    positive = (p - q).clamp_min(0.0)
    mass = positive.sum(-1, keepdim=True)
    return torch.where(mass > 0, positive / mass, p)  # the 0/0 branch is discarded


def output_distribution_one_step(p: Tensor, q: Tensor) -> Tensor:
    """Analytic distribution of the token emitted by one accept/reject step: draw x ~ q, keep it with
    acceptance_probability, else draw from residual_distribution. Built from those two functions so
    that a test of "this equals p" checks the implementation itself. p, q: [..., V]."""
    vocab = torch.arange(p.shape[-1], device=p.device).expand(p.shape)
    accept = acceptance_probability(p, q, vocab)
    p_reject = (q * (1.0 - accept)).sum(-1, keepdim=True)
    return q * accept + p_reject * residual_distribution(p, q)


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Greedy verification. target_argmax[i] is the target's argmax after the context plus
    draft_tokens[:i], for i in 0..k (k+1 entries). Accept drafts while they equal the target's
    choice; the first mismatch emits the target's token and stops; if all k match, the target's
    bonus token follows. Returns the 1..k+1 emitted tokens, each equal to the target's argmax."""
    k = len(draft_tokens)
    if len(target_argmax) != k + 1:
        raise ValueError(f"need k+1 = {k + 1} target tokens, got {len(target_argmax)}")
    emitted: list[int] = []
    for drafted, target in zip(draft_tokens, target_argmax, strict=False):  # the first k; bonus below
        emitted.append(int(target))  # equals the draft when accepted, corrects it when not
        if drafted != target:
            return emitted
    emitted.append(int(target_argmax[k]))
    return emitted


def verify_sampled(
    draft_tokens: Sequence[int],
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Sampled verification (Leviathan et al. 2023, Algorithm 1). Returns the 1..k+1 emitted tokens.

    target_probs: [k+1, V]; row i is p after the context plus draft_tokens[:i].
    draft_probs: [k, V], row i the q that draft_tokens[i] was drawn from; or None when each q_i is a
    point mass on draft_tokens[i] (n-gram proposer): acceptance is then p_i(x_i) and the residual is
    p_i with x_i zeroed, renormalized.

    Draft i is accepted with probability min(1, p_i(x_i)/q_i(x_i)); the first rejection emits a
    sample of residual(p_i, q_i) and stops; if all k are accepted, a bonus token is drawn from p_k.

    Randomness: k uniforms, then exactly one categorical draw, all from `generator` (a per-request
    torch.Generator; its device is where they are drawn), so the result depends only on the inputs
    and the generator's state, never on which other requests share the batch.
    """
    k = len(draft_tokens)
    vocab = target_probs.shape[-1]
    if target_probs.shape != (k + 1, vocab):
        raise ValueError(f"target_probs must be [k+1={k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (k, vocab):
        raise ValueError(f"draft_probs must be [k={k}, V={vocab}], got {tuple(draft_probs.shape)}")
    p = target_probs[:k]
    drafted = torch.tensor(list(draft_tokens), dtype=torch.long, device=p.device)
    if draft_probs is None:
        accept = p.gather(-1, drafted.unsqueeze(-1)).squeeze(-1)  # min(1, p(x) / 1)
    else:
        accept = acceptance_probability(p, draft_probs, drafted)
    rand_device = generator.device if generator is not None else torch.device("cpu")
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64, device=rand_device)

    emitted: list[int] = []
    for i, (x, a, u) in enumerate(zip(draft_tokens, accept.tolist(), uniforms.tolist(), strict=True)):
        if u >= a:  # rejected: P(u < a) = a for u ~ U[0, 1)
            q_i = draft_probs[i] if draft_probs is not None else _point_mass(int(x), p[i])
            emitted.append(_sample(residual_distribution(p[i], q_i), generator))
            return emitted
        emitted.append(int(x))
    emitted.append(_sample(target_probs[k], generator))
    return emitted


def _point_mass(x: int, like: Tensor) -> Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    # multinomial never picks a zero-probability token, unlike a naive inverse-CDF lookup.
    if generator is not None:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())
