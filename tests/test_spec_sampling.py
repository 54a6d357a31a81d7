"""Sampled speculative decoding keeps the target's distribution (book §31.5; Leviathan et al. 2023).

Many seeded requests (each its own generator) sample their first tokens with speculation; for every
context seen often enough (the prompt, prompt + t1, prompt + t1 t2) the next-token counts pass a
chi-square goodness-of-fit test against the target's exact policy probabilities, computed without
speculation. The drafts cover positions 2..3, so the test sees accepted drafts, residual samples
after rejections, and bonus tokens. Fixed seeds make it deterministic; the threshold is conservative.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams

NUM_REQUESTS = 240
MAX_TOKENS = 4  # the first speculative step drafts positions 2-3 (the cap keeps room for a bonus)
TESTED_POSITIONS = 3
MIN_CONTEXT_COUNT = 30  # contexts seen fewer times are left out (too few draws for the chi-square)
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled into one "other" cell
TOP = 20  # logprobs returned per position; covers the policy's support (top_k <= TOP) or most mass

CASES: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    # A self-draft of 12 of 30 layers: q differs from p, so both acceptance and residual draws occur.
    "self-draft": (
        {"method": "draft", "num_tokens": 3, "draft_layers": 12, "adaptive": False},
        "The capital of France is",
        {"temperature": 1.0},
    ),
    # n-gram drafts are point masses; a repetitive prompt makes them frequent. Temperature and top-k
    # must then apply identically in verification.
    "ngram": (
        {"method": "ngram", "num_tokens": 3, "adaptive": False},
        "a b c d a b c d a b c d a b",
        {"temperature": 0.8, "top_k": 10},
    ),
}


def _policy_probs(top: list[tuple[int, float]], policy: dict[str, Any]) -> dict[int, float]:
    """Exact policy probabilities of the top tokens from raw logprobs: temperature, then top-k.
    Without top-k only temperature 1 is supported (the raw distribution itself)."""
    top_k = policy.get("top_k", 0)
    if not top_k:
        assert policy["temperature"] == 1.0
        return {token: math.exp(lp) for token, lp in top}
    kept = top[:top_k]
    scaled = torch.tensor([lp for _, lp in kept], dtype=torch.float64) / policy["temperature"]
    return dict(zip([t for t, _ in kept], scaled.softmax(0).tolist(), strict=True))


def _chi_square(counts: Counter, probs: dict[int, float]) -> tuple[float, int]:
    """Statistic and degrees of freedom; rare cells pooled with the mass outside `probs`."""
    n = sum(counts.values())
    cells = [t for t, p in probs.items() if n * p >= MIN_EXPECTED]
    observed = [counts[t] for t in cells]
    expected = [n * probs[t] for t in cells]
    other_expected = n - sum(expected)
    other_observed = n - sum(observed)
    if other_expected > 1e-6 * n:
        observed.append(other_observed)
        expected.append(other_expected)
    else:
        assert other_observed == 0, "a token outside the policy's support was emitted"
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    return stat, len(observed) - 1


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_speculation_matches_the_target_distribution(case, llm_fp32):
    spec, prompt, policy = CASES[case]
    llm = LLM(dtype="float32", num_kv_blocks=512, max_num_seqs=NUM_REQUESTS, speculative=spec)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, **policy) for seed in range(NUM_REQUESTS)
    ]
    samples = [o.outputs[0].token_ids for o in llm.generate([prompt] * NUM_REQUESTS, params)]
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]  # both paths taken

    # next-token counts per context (the tokens before it), for the first TESTED_POSITIONS tokens
    by_context: dict[tuple[int, ...], Counter] = {}
    for tokens in samples:
        for position in range(TESTED_POSITIONS):
            by_context.setdefault(tuple(tokens[:position]), Counter())[tokens[position]] += 1
    contexts = [c for c, counts in by_context.items() if sum(counts.values()) >= MIN_CONTEXT_COUNT]
    assert any(len(c) == TESTED_POSITIONS - 1 for c in contexts), "no context deep enough to test"

    # exact next-token distributions from the target alone (llm_fp32 has no speculation)
    prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    exact = llm_fp32.generate(
        [prompt_ids + list(c) for c in contexts], SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    )
    total_stat, total_df = 0.0, 0
    for context, out in zip(contexts, exact, strict=True):
        stat, df = _chi_square(by_context[context], _policy_probs(out.outputs[0].logprobs[0].top, policy))
        total_stat += stat
        total_df += df
    assert total_df >= 5
    p_value = torch.special.gammaincc(torch.tensor(total_df / 2, dtype=torch.float64), torch.tensor(total_stat / 2))
    assert p_value.item() > 1e-4, f"chi-square {total_stat:.1f} on {total_df} df over {len(contexts)} contexts"
