"""bf16 (the default dtype on CPUs with AVX512-BF16) against float32 on the real bundled model, and the
agreement measures kvserve/bench/agreement.py defines.

Teacher-forced, each bf16 token is predicted from float32's own context, so one rounding flip does not
carry into the positions after it. HF transformers' bf16 agrees with its float32 at 97 % of positions
on benchmarks/dtype_agreement.py's prompts, kvserve's at 98 %; 90 % leaves room for near-ties on these
few prompts, while a broken bf16 kernel lands far below it."""

from __future__ import annotations

from kvserve import LLM, SamplingParams
from kvserve.bench.agreement import free_running, teacher_forced_agreement

TOPICS = ["the sea", "photosynthesis", "trains", "chess"]


def test_free_running_counts_identical_requests_and_the_tokens_before_the_first_difference() -> None:
    reference = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    other = [[1, 9, 3], [4, 5], [6, 7, 8, 0, 0]]
    figures = free_running(reference, other)
    assert figures["requests_identical"] == 1 / 3
    assert figures["tokens_before_first_divergence"] == (1 + 2 + 3) / 10


def test_bf16_predicts_float32s_greedy_token_at_most_positions(llm_fp32) -> None:
    bf16 = LLM(dtype="bfloat16")
    prompts = [
        bf16.tokenizer.encode_chat([{"role": "user", "content": f"Write two sentences about {topic}."}])
        for topic in TOPICS
    ]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = [o.token_ids for o in llm_fp32.generate(prompts, greedy)]
    assert teacher_forced_agreement(llm_fp32, prompts, reference) == 1.0  # the measure against itself
    assert teacher_forced_agreement(bf16, prompts, reference) >= 0.9
