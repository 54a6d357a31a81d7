"""Bad input gets a clear ValueError naming the field, and leaves the engine serving."""

from __future__ import annotations

import pytest

from kvserve import LLM, EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 99}, "logprobs"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "float8"}, "dtype"),
        ({"attention_backend": "magic"}, "attention_backend"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
    ],
)
def test_engine_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model="no-such-model")


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm_fp32):
    engine = llm_fp32.engine
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm_fp32.generate([""], greedy)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("empty-ids", [], greedy)
    with pytest.raises(ValueError, match="max_model_len"):
        llm_fp32.generate([[100] * engine.max_model_len], greedy)
    with pytest.raises(ValueError, match="max_tokens"):
        llm_fp32.generate([[100, 101]], SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="token ids"):
        llm_fp32.generate([[100, 10**9]], greedy)
    with pytest.raises(ValueError, match="n must be at most"):
        llm_fp32.generate(["hi"], SamplingParams(n=10_000))
    # Nothing leaked, and the engine still answers.
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert llm_fp32.generate(["The capital of France is"], greedy)[0].token_ids
