"""The bundled SmolLM2 GGUF (Q4_1 projections, a Q8_0 embedding table tied to the LM head) served from
its own blocks (`quantization="auto"`) against the same file dequantized to float32.

Both engines compute in float32 here, so the comparison isolates the quantized kernels: the panel
product differs from dequantize-then-matmul only in summation order, the batch-1 GEMV by its int8
activations. (In bf16, native and dequantized weights agree with float32 at the same 97.9 % of these
positions: bf16's own rounding, benchmarks/RESULTS.md.)"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve import LLM, EngineConfig, SamplingParams
from kvserve.bench.agreement import free_running, teacher_forced_agreement
from kvserve.model.quantized import ROW_GROUP_TYPE_OFFSET, QuantizedTensor
from kvserve.model.quantized_linear import quantized_kernels
from kvserve.model.registry import DEFAULT_MODEL, load_model
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread
from tests.test_decode_layers import BATCH, generate

pytestmark = pytest.mark.skipif(quantized_kernels() is None, reason="the quantized kernels need AVX2, FMA, F16C")
TOPICS = ["the sea", "photosynthesis", "trains", "chess"]
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def llm_native() -> LLM:
    return LLM(quantization="auto", dtype="float32")


def test_the_loader_keeps_the_blocks_and_they_hold_the_dequantized_values() -> None:
    loaded = load_model(DEFAULT_MODEL)
    native, dense = loaded.load_weights(torch.float32, keep_quantized=True), loaded.load_weights(torch.float32)
    for name in PROJECTIONS:  # q and k rows un-permuted as in the dense load, the fused parts in order
        weight = getattr(native.layers[3], name)
        assert isinstance(weight, QuantizedTensor) and weight.qtype == GGMLQuantizationType.Q4_1
        torch.testing.assert_close(weight.dequantize(), getattr(dense.layers[3], name), rtol=0, atol=0)
    assert native.lm_head is native.embed_tokens and native.embed_tokens.qtype == GGMLQuantizationType.Q8_0
    assert native.quantization() == "Q4_1 x 120, Q8_0 x 1" and dense.quantization() == "none"


def test_native_weights_follow_the_dequantized_float32_engine(llm_fp32, llm_native) -> None:
    """Teacher-forced: at each position the native engine sees the dequantized engine's output so far;
    the issue's bar is 99 % of positions (measured here: 100 %)."""
    prompts = [
        llm_native.tokenizer.encode_chat([{"role": "user", "content": f"Write two sentences about {topic}."}])
        for topic in TOPICS
    ]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.token_ids for o in llm_fp32.generate(prompts, greedy)]
    agreement = teacher_forced_agreement(llm_native, prompts, reference)
    free = free_running(reference, [o.token_ids for o in llm_native.generate(prompts, greedy)])
    print(f"teacher-forced agreement {agreement:.3f}, free-running {free}")
    assert agreement >= 0.99


def test_an_unknown_quantization_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def test_the_quantization_is_in_the_fingerprint_and_the_model_facts(llm_fp32, llm_native) -> None:
    assert llm_native.engine.quantization == "Q4_1 x 120, Q8_0 x 1"
    assert llm_fp32.engine.quantization == "none"
    assert llm_native.engine.fingerprint != llm_fp32.engine.fingerprint


@pytest.mark.parametrize("rows", [1, 5], ids=["batch 1: quant_gemv", "batch 5: quant_linear"])
def test_the_compiled_decode_step_takes_the_blocks_and_gives_the_python_loops_tokens(rows: int) -> None:
    """Without prefix caching, so that both runs prefill the same rows through the same kernels."""
    llm = LLM(quantization="auto", dtype="float32", enable_prefix_caching=False)
    # every projection of SmolLM2's file is Q4_1 with a multiple of 8 rows: all in row groups
    block_types = llm.engine.model.compiled_decode.decode_model.block_types
    assert block_types == [ROW_GROUP_TYPE_OFFSET + GGMLQuantizationType.Q4_1] * 120
    try:
        compiled, ran = generate(llm, BATCH[:rows], compiled=True)
        python, ran_without = generate(llm, BATCH[:rows], compiled=False)
    finally:
        llm.engine.runner.compiled_decode = True
    assert ran and not ran_without
    assert compiled == python


def test_greedy_generation_through_the_server() -> None:
    """The server on native weights, in the default dtype (bf16 on AVX2 CPUs with the kernels), answers
    /v1/models with the quantization and generates, greedily, what the same engine did offline."""
    prompt = "The capital of France is"
    llm = LLM(quantization="auto")
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text
    async_engine = AsyncEngine(llm.engine).start()
    try:
        with ServerThread(build_app(async_engine)) as server:
            (card,) = httpx.get(f"{server.base_url}/v1/models").json()["data"]
            assert card["quantization"] == "Q4_1 x 120, Q8_0 x 1"
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            out = client.completions.create(model=card["id"], prompt=prompt, max_tokens=12, temperature=0)
    finally:
        async_engine.shutdown()
    assert out.choices[0].text == expected and expected.strip()
