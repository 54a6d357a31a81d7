"""Sampling: policy distributions, per-request seeded generators, stops, EOS, logprobs."""

from __future__ import annotations

import torch

from kvserve import SamplingParams
from kvserve.engine.sampler import policy_probs

PROMPT = "Once upon a time"


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top_k = policy_probs(logits, [SamplingParams(top_k=2)])
    assert torch.allclose(top_k, torch.tensor([[0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]]))
    # top_p=0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.1 is not.
    top_p = policy_probs(logits, [SamplingParams(top_p=0.8)])
    assert torch.allclose(top_p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    hot = policy_probs(logits, [SamplingParams(temperature=0.5)])
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(hot[0], expected / expected.sum())
    greedy = policy_probs(logits, [SamplingParams(temperature=0)])
    assert greedy[0].tolist() == [1.0, 0, 0, 0, 0]


def test_seeded_output_does_not_depend_on_batch(llm_fp32):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm_fp32.generate([PROMPT], seeded)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm_fp32.generate(["Hello", PROMPT, "The sky is"], [others, seeded, others])
    assert batch[1].token_ids == alone
    other_seed = llm_fp32.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=16, seed=4321))[0]
    assert other_seed.token_ids != alone


def test_stop_string_is_never_emitted_even_partially(llm_fp32):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm_fp32.generate([PROMPT], greedy)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    cut = full[: full.index(stop)]
    engine = llm_fp32.engine
    engine.add_request("stop", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    snapshots = []
    while engine.has_unfinished_requests():
        snapshots += [o.text for o in engine.step() if o.request_id == "stop"]
    assert snapshots[-1] == cut
    for text in snapshots:
        assert cut.startswith(text), "a streamed snapshot showed text past the stop point"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_stop_token_ids_eos_and_ignore_eos(llm_fp32):
    chat = llm_fp32.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    eos = llm_fp32.tokenizer.eos_token_id
    stopped = llm_fp32.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
    assert "<|im_end|>" not in stopped.text
    ignored = llm_fp32.generate(
        [chat], SamplingParams(temperature=0, max_tokens=len(stopped.token_ids) + 3, ignore_eos=True)
    )[0]
    assert ignored.finish_reason == "length"
    assert ignored.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # EOS emitted, not masked
    first = stopped.token_ids[1]
    by_id = llm_fp32.generate([chat], SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[first]))[0]
    assert by_id.token_ids == stopped.token_ids[:2] and by_id.outputs[0].stop_reason == first


def test_logprobs_of_chosen_tokens(llm_fp32):
    out = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    logprobs = out.outputs[0].logprobs
    assert [lp.token_id for lp in logprobs] == out.token_ids
    for lp in logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert abs(lp.top[0][1] - lp.logprob) < 1e-5


def test_emission_times_are_recorded_per_token(llm_fp32):
    out = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    m = out.metrics
    assert len(m.token_times) == 6
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == m.token_times[0]
    assert m.token_times == sorted(m.token_times) and m.finished_time == m.token_times[-1]
