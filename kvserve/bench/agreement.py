"""How closely one engine's greedy tokens follow a reference's (bf16 against float32, say).

Two measures, because they answer different questions:
- free-running (`free_running`): each engine generates on its own; the share of requests identical and
  of tokens before each request's first difference. One flipped near-tie changes the context of every
  later token, so a single rounding difference early in a request counts against all that follow;
- teacher-forced (`teacher_forced_agreement`): at each position the engine sees the reference's output
  so far as its context; the share of positions where its greedy token is the reference's. This is the
  per-token agreement, without that compounding.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.llm import LLM
from kvserve.engine.sampling_params import SamplingParams


def free_running(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, float]:
    """Share of requests identical, and of reference tokens before each request's first difference."""
    same_prefix = sum(
        next((i for i, (a, b) in enumerate(zip(r, o, strict=False)) if a != b), min(len(r), len(o)))
        for r, o in zip(reference, other, strict=True)
    )
    identical = sum(list(r) == list(o) for r, o in zip(reference, other, strict=True))
    return {
        "requests_identical": identical / len(reference),
        "tokens_before_first_divergence": same_prefix / sum(len(r) for r in reference),
    }


def forced_contexts(prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each prompt followed by the reference's output before each of its positions, in order."""
    return [list(p) + list(ref[:i]) for p, ref in zip(prompts, reference, strict=True) for i in range(len(ref))]


def share_matching(predicted: Sequence[int], reference: Sequence[Sequence[int]]) -> float:
    """Share of the reference's tokens (flattened as forced_contexts orders them) that `predicted` names."""
    expected = [t for ref in reference for t in ref]
    return sum(p == e for p, e in zip(predicted, expected, strict=True)) / len(expected)


def teacher_forced_agreement(llm: LLM, prompts: Sequence[list[int]], reference: Sequence[Sequence[int]]) -> float:
    """Share of positions where `llm`'s greedy token, given the prompt and the reference's output before
    that position, is the reference's token. Runs through the serving path: one single-token request
    per (prompt, position)."""
    outputs = llm.generate(forced_contexts(prompts, reference), SamplingParams(temperature=0, max_tokens=1))
    return share_matching([o.token_ids[0] for o in outputs], reference)


def greedy_agreement(llm: LLM, prompts: Sequence[list[int]], reference: Sequence[Sequence[int]]) -> dict[str, float]:
    """Both measures of `llm` against `reference` (greedy outputs of `prompts`, all of one length)."""
    greedy = SamplingParams(temperature=0, max_tokens=len(reference[0]), ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(list(prompts), greedy)]
    return {
        **free_running(reference, outputs),
        "teacher_forced_token_agreement": teacher_forced_agreement(llm, prompts, reference),
    }
