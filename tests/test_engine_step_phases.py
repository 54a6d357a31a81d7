"""A step's phases (forward, sampling, verification, output) each fail only the requests they served: the
other requests of the step go on to the tokens they give alone, and every KV block comes back."""

from __future__ import annotations

import pytest

from kvserve import EngineConfig, SamplingParams
from kvserve.engine import engine as engine_module
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG_PROMPT = "Once upon a time, in a land far away, " * 8  # ~90 tokens: prefills over several 32-token steps
REPETITIVE = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8,"


def make_engine(**overrides: object) -> LLMEngine:
    config = {"dtype": "float32", "enable_prefix_caching": False, "max_num_batched_tokens": 32, **overrides}
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.pool.num_used == 0
    return finals


def alone(prompt: str, params: SamplingParams = GREEDY, **overrides: object) -> list[int]:
    engine = make_engine(**overrides)
    engine.add_request("alone", prompt, params)
    return run(engine)["alone"].outputs[0].token_ids


def fail_first_call(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> list[int]:
    """Make `target.name` raise on its first call, then behave; returns the list of calls made."""
    real, calls = getattr(target, name), []

    def once(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, once)
    return calls


def test_a_failed_forward_pass_fails_each_scheduled_request_once(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    engine.add_request("a", "The capital of France is", GREEDY)
    engine.add_request("b", "Hello", SamplingParams(temperature=0.8, max_tokens=4, n=2))
    fail_first_call(monkeypatch, engine.runner, "execute")
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]  # one output per request, not per sample
    assert all(o.finished and "injected fault" in (o.error or "") for o in outputs)
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    engine.add_request("c", "The capital of France is", GREEDY)
    assert run(engine)["c"].outputs[0].token_ids == alone("The capital of France is")


def test_a_failed_sampling_fails_the_sampled_requests_and_not_a_prefilling_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = make_engine()
    engine.add_request("short", "Hello", GREEDY)
    engine.add_request("long", LONG_PROMPT, GREEDY)
    fail_first_call(monkeypatch, engine_module, "sample_rows")
    finals = run(engine)
    assert "injected fault" in (finals["short"].error or "")
    assert finals["long"].error is None
    assert finals["long"].outputs[0].token_ids == alone(LONG_PROMPT)


def test_a_failed_verification_fails_that_request_only(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"speculative": {"method": "ngram", "num_tokens": 4}}
    engine = make_engine(**spec)
    assert engine.speculator is not None
    engine.add_request("first", REPETITIVE, GREEDY)
    engine.add_request("second", REPETITIVE, GREEDY)
    calls = fail_first_call(monkeypatch, engine.speculator, "verify")
    finals = run(engine)
    assert calls, "the step must have verified drafts for the fault to be injected"
    failed = [rid for rid, out in finals.items() if out.error is not None]
    assert len(failed) == 1
    (survivor,) = set(finals) - set(failed)
    assert finals[survivor].outputs[0].token_ids == alone(REPETITIVE, **spec)


def test_a_failure_while_emitting_fails_that_request_only(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    engine.add_request("a", "The capital of France is", GREEDY)
    engine.add_request("b", "def fibonacci(n):", GREEDY)
    real_append = engine_module.append_token

    def append_failing_for_b(seq, *args, **kwargs):  # type: ignore[no-untyped-def]
        if seq.request.request_id == "b" and seq.num_output_tokens == 2:
            raise RuntimeError("injected fault")
        return real_append(seq, *args, **kwargs)

    monkeypatch.setattr(engine_module, "append_token", append_failing_for_b)
    finals = run(engine)
    assert "injected fault" in (finals["b"].error or "")
    assert finals["a"].error is None
    assert finals["a"].outputs[0].token_ids == alone("The capital of France is")
