"""The compiled decode step (kernels/cpu/decode_layers.cpp) against the Python layer loop it replaces,
on the real bundled model in bf16: same kernels in the same order, so the same tokens."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu
from kvserve.model import linear

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm_bf16() -> LLM:
    if cpu.load() is None:
        pytest.fail("the CPU kernels must build on the machines kvserve is tested on")
    if linear.gemv_kernels() is None:
        pytest.skip("this path's kernels have no bf16 GEMV (the generic path): no compiled bf16 step")
    return LLM(dtype="bfloat16", enable_prefix_caching=False)


def generate(llm: LLM, prompts: list[str], compiled: bool, **params) -> tuple[list[list[int]], bool]:
    """Token ids, and whether any step ran the compiled decode call."""
    llm.engine.runner.compiled_decode = compiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **params))
    return [o.token_ids for o in outs], any(e.key == "kvserve::decode_layers" for e in prof.key_averages())


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch 1", "batch 2"])
def test_compiled_decode_gives_the_python_loops_tokens(llm_bf16, prompts) -> None:
    assert llm_bf16.engine.runner.compiled_decode, "the default CPU backend must allow the compiled step"
    try:
        compiled, ran = generate(llm_bf16, prompts, compiled=True)
        python, ran_without = generate(llm_bf16, prompts, compiled=False)
    finally:
        llm_bf16.engine.runner.compiled_decode = True
    assert ran and not ran_without
    assert compiled == python
    assert all(len(ids) == 12 for ids in compiled)


BATCH = [*PROMPTS, "Once upon a time", "The three primary colors are", "import numpy as np"]


def test_batched_decode_takes_the_compiled_step_where_the_tile_kernels_run(llm_bf16) -> None:
    """Five sequences decoding together are five rows: past the GEMV, so the compiled step runs only
    where every projection has packed tiles (linear_amx, or linear_tiles_fma where the CPU has no AMX and
    the probe chose it), and then gives the Python loop's tokens."""
    tiled = bool(llm_bf16.engine.model.compiled_decode.decode_model.tiles)
    assert tiled == (linear.batched_product_kernel() in linear.TILE_PRODUCTS)
    try:
        compiled, ran = generate(llm_bf16, BATCH, compiled=True)
        python, ran_without = generate(llm_bf16, BATCH, compiled=False)
    finally:
        llm_bf16.engine.runner.compiled_decode = True
    assert ran == tiled and not ran_without
    assert compiled == python


def test_a_step_with_a_prefill_chunk_runs_the_python_loop(llm_bf16) -> None:
    """A prompt longer than a decode row's query goes to the attention the Python loop picks for it."""
    long_prompt = " ".join(["word"] * 40)
    llm_bf16.engine.runner.compiled_decode = True
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm_bf16.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1))
    assert not any(e.key == "kvserve::decode_layers" for e in prof.key_averages())


def test_float32_models_never_take_the_bf16_step(llm_fp32) -> None:
    assert llm_fp32.engine.model.dtype == torch.float32
    assert llm_fp32.engine.model.compiled_decode is None


def test_speculative_verify_steps_take_the_compiled_step_and_give_the_same_tokens() -> None:
    """A verify step's rows (a few tokens per sequence) are decode rows of the compiled step; with packed
    tiles (linear_amx's or linear_tiles_fma's) every step after the prompts' prefill runs it, with the
    tokens of the Python loop."""
    # The planner off: every step drafts, whatever this path's measured costs would make it choose.
    speculative = {"method": "ngram", "num_tokens": 4, "adaptive": False}
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, speculative=speculative)
    compiled_step = llm.engine.model.compiled_decode
    if compiled_step is None or not compiled_step.decode_model.tiles:
        pytest.skip("verify steps of several rows take the compiled step only with packed tiles")
    repetitive = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "the cat sat on the mat, the cat sat on the mat,"]
    steps_before = llm.engine.stats()["steps"]
    llm.engine.runner.compiled_decode = True
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled = [o.token_ids for o in llm.generate(repetitive, params)]
    steps = llm.engine.stats()["steps"] - steps_before
    calls = sum(e.count for e in prof.key_averages() if e.key == "kvserve::decode_layers")
    assert calls == steps - 1  # all but the one prefill step, verify steps included
    assert llm.engine.stats()["spec_accepted_tokens"] > 0  # the steps did verify drafts
    llm.engine.runner.compiled_decode = False
    assert [o.token_ids for o in llm.generate(repetitive, params)] == compiled
