"""logit_bias, min_tokens, presence / frequency / repetition penalties and min_p: against a reference
written token by token from the OpenAI / vLLM definitions, and on the real bundled model."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.logits_processors import process_logits
from kvserve.engine.outputs import RequestMetrics
from kvserve.engine.sampler import policy_probs
from kvserve.engine.sequence import Request, Sequence
from kvserve.structured.grammar import StructuredOutput

PROMPT = "List the days of the week:"
VOCAB = 12


def make_seq(tokenizer, prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    request = Request("r", None, prompt, params, RequestMetrics(0.0), None, b"", 0, 0, tokenizer)
    seq = request.new_sequence(0)
    seq.token_ids += output
    return seq


def reference_row(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """One row, one token at a time, straight from the definitions (vLLM's order)."""
    row = list(logits)
    for token, bias in p.logit_bias.items():
        row[token] += bias
    counts = Counter(output)
    for t in range(len(row)):
        if t in counts or t in prompt:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return row


def test_penalties_and_bias_match_the_reference(llm_fp32) -> None:
    tokenizer = llm_fp32.tokenizer
    gen = torch.Generator().manual_seed(0)
    cases = [
        ([1, 2], [3, 3, 3, 4], SamplingParams(frequency_penalty=0.7)),
        ([1, 2], [3, 3, 3, 4], SamplingParams(presence_penalty=1.5)),
        ([1, 2], [3, 3, 3, 4], SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.0)),
        ([5, 6, 5], [7], SamplingParams(repetition_penalty=1.8)),
        ([5], [], SamplingParams(repetition_penalty=0.5, logit_bias={0: -100.0, 9: 3.5})),
        ([], [8, 8], SamplingParams()),  # untouched row in a processed batch
        ([2, 9], [9, 10, 9], SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)),
    ]
    seqs = [make_seq(tokenizer, prompt or [0], out, p) for prompt, out, p in cases]
    logits = torch.randn(len(cases), VOCAB, generator=gen) * 3
    raw = logits.clone()
    got = process_logits(logits, seqs, [[] for _ in seqs])
    assert torch.equal(logits, raw), "the raw logits (used for logprobs) must not change"
    for row, (prompt, out, p) in enumerate(cases):
        expected = reference_row(raw[row].tolist(), prompt or [0], out, p)
        assert got[row].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-5), p


def test_unprocessed_batch_is_returned_as_is(llm_fp32) -> None:
    logits = torch.randn(2, VOCAB)
    seqs = [make_seq(llm_fp32.tokenizer, [1], [2], SamplingParams(top_k=3)) for _ in range(2)]
    assert process_logits(logits, seqs, [[], []]) is logits


def test_min_tokens_bans_stop_tokens_until_reached(llm_fp32) -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[7])
    early = make_seq(llm_fp32.tokenizer, [1], [2, 3], params)
    late = make_seq(llm_fp32.tokenizer, [1], [2, 3, 4], params)
    got = process_logits(torch.zeros(2, VOCAB), [early, late], [[5], [5]])
    assert got[0, 5] == -math.inf and got[0, 7] == -math.inf and got[0, 4] == 0
    assert bool((got[1] == 0).all())


def test_min_p_keeps_exactly_the_reference_set() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    for min_p in (0.0, 0.2, 0.3, 0.5, 1.0):
        kept = [p for p in probs[0].tolist() if p >= min_p * 0.4]
        expected = torch.tensor([p if p >= min_p * 0.4 else 0.0 for p in probs[0].tolist()]) / sum(kept)
        got = policy_probs(probs.log(), [SamplingParams(min_p=min_p)])
        assert torch.allclose(got[0], expected, atol=1e-6), min_p
    # min_p is applied after temperature: at temperature 2 the ratios are square roots.
    hot = policy_probs(probs.log(), [SamplingParams(min_p=0.6, temperature=2.0)])
    assert (hot[0] > 0).tolist() == [True, True, True, False, False]  # sqrt(0.1/0.4)=0.5 < 0.6


def test_logit_bias_bans_and_forces_tokens(llm_fp32) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm_fp32.generate(PROMPT, greedy)[0].token_ids
    banned = llm_fp32.generate(PROMPT, SamplingParams(**{**vars(greedy), "logit_bias": {plain[0]: -100}}))[0]
    assert plain[0] not in banned.token_ids
    forced_token = llm_fp32.tokenizer.encode(" banana")[0]
    forced = llm_fp32.generate(
        PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logit_bias={forced_token: 100})
    )[0]
    assert forced.token_ids == [forced_token] * 6


def test_penalties_change_repetition_in_the_expected_direction(llm_fp32) -> None:
    prompt = "Say the word 'yes' many times: yes yes yes"
    penalties = [{}, {"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8}]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **p) for p in penalties]
    outputs = llm_fp32.generate([prompt] * len(params), params)  # one batch: rows are independent
    repeats = [len(o.token_ids) - len(set(o.token_ids)) for o in outputs]
    assert repeats[0] > 8, "the prompt should make the model repeat itself"
    assert all(r < repeats[0] for r in repeats[1:]), repeats


def test_processed_seeded_request_is_independent_of_the_batch(llm_fp32) -> None:
    seeded = SamplingParams(
        temperature=1.0, seed=99, max_tokens=12, ignore_eos=True, frequency_penalty=0.8, min_p=0.05, logit_bias={11: 5}
    )
    digits = StructuredOutput("regex", "[0-9]{12}")
    constrained = SamplingParams(temperature=1.0, seed=98, max_tokens=16, repetition_penalty=1.2, structured=digits)
    alone = [llm_fp32.generate(PROMPT, p)[0].token_ids for p in (seeded, constrained)]
    others = [
        SamplingParams(temperature=0.7, max_tokens=14, presence_penalty=-1.0, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5, logit_bias={alone[0][0]: -100}),
        SamplingParams(temperature=1.0, max_tokens=16, structured=digits),
    ]
    batch = llm_fp32.generate(
        ["Hello", PROMPT, "The sky is", PROMPT, PROMPT], [others[0], seeded, others[1], constrained, others[2]]
    )
    assert [batch[1].token_ids, batch[3].token_ids] == alone
