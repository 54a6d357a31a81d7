"""Every family read from GGUF keeps its matrices in blocks (`quantization="auto"`), on tiny random
checkpoints written with the mixed block types llama.cpp's quantization mixes use: fused q|k|v and
gate|up whose parts differ in block type stay in their blocks, part by part (StackedQuantizedTensor).
The reference is kvserve over the same file dequantized, in float32.

Prefill steps of more than GEMV_MAX_ROWS rows take the panel product, which differs from
dequantize-then-matmul only in summation order: there logprobs are the reference's. Decode steps (of
up to int8_max_rows rows) take the GEMV, whose activations are quantized to int8 per 32 values (as
llama.cpp's are): on these checkpoints, drawn for sharp attention and large logits, that moves
logprobs by up to about one nat, so decoding, one at a time or batched, is held to a teacher-forced
agreement bound.
Gemma 3's real Q4_K_M file: tests/test_gemma3_270m.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.model.quantized import QuantizedTensor, StackedQuantizedTensor
from kvserve.model.quantized_linear import quantized_kernels
from kvserve.model.registry import load_model
from tests.family_checkpoints import VOCAB, save_checkpoint, write_gguf

pytestmark = pytest.mark.skipif(quantized_kernels() is None, reason="the quantized kernels need AVX2, FMA, F16C")
# q and k in one type, v in another (as Q4_K_M files do), gate and up apart too; lm_head applies only
# where the family's head is untied (Qwen2 here).
BLOCK_TYPES = {
    "self_attn.q_proj": Q.Q8_0,
    "self_attn.k_proj": Q.Q8_0,
    "self_attn.v_proj": Q.Q5_0,
    "self_attn.o_proj": Q.Q4_0,
    "mlp.gate_proj": Q.Q8_0,
    "mlp.up_proj": Q.Q4_1,
    "mlp.down_proj": Q.Q5_0,
    "embed_tokens": Q.Q8_0,
    "lm_head": Q.Q8_0,
}
NEW_TOKENS = 32
# Share of batch-1 decoded tokens that are the reference's greedy choice given the same context; the
# test prints what these checkpoints give. The real Gemma 3 file is held to the 0.99.
MIN_GEMV_AGREEMENT = 0.95
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_gen = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_gen).tolist() for n in (3, 20, 41)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def quantized_gguf(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = save_checkpoint(request.param, directory)
    write_gguf(request.param, model, directory / "model.gguf", BLOCK_TYPES)
    return directory / "model.gguf"


def test_mixed_fused_parts_stay_in_their_blocks(quantized_gguf):
    weights = load_model(str(quantized_gguf)).load_weights(torch.float32, keep_quantized=True)
    dense = load_model(str(quantized_gguf)).load_weights(torch.float32)
    layer, dense_layer = weights.layers[1], dense.layers[1]
    assert isinstance(layer.qkv_proj, StackedQuantizedTensor)
    assert [p.qtype for p in layer.qkv_proj.parts] == [Q.Q8_0, Q.Q5_0]  # q|k fused, v apart
    assert [p.qtype for p in layer.gate_up_proj.parts] == [Q.Q8_0, Q.Q4_1]
    assert isinstance(layer.o_proj, QuantizedTensor) and layer.o_proj.qtype == Q.Q4_0
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):  # the same values as the dense load
        torch.testing.assert_close(getattr(layer, name).dequantize(), getattr(dense_layer, name), rtol=0, atol=0)


@pytest.mark.parametrize("length", [73, 6], ids=["73 tokens", "6 tokens"])
def test_prompt_logprobs_over_the_blocks_are_the_dequantized_engines(quantized_gguf, length: int):
    """Every position of a prompt through the panel product: the family's whole layer (fused parts in
    order, q/k rows un-permuted, biases, head norms) over the blocks. A prompt as short as a verify step
    (6 rows) is still a prefill: exact, not on the int8 GEMV."""
    sequence = (PROMPTS[2] + PROMPTS[1] + list(range(3, 15)))[:length]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    entries = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=str(quantized_gguf), dtype="float32", num_kv_blocks=48, quantization=quantization)
        entries[quantization] = llm.generate([sequence], params)[0].prompt_logprobs[1:]
    for blocks, dense in zip(entries["auto"], entries["none"], strict=True):
        assert [t for t, _ in blocks.top] == [t for t, _ in dense.top]
        torch.testing.assert_close([lp for _, lp in blocks.top], [lp for _, lp in dense.top], rtol=0, atol=1e-3)


@pytest.mark.parametrize("batched", [False, True], ids=["one at a time", "three per step"])
def test_decoding_follows_the_dequantized_engine(quantized_gguf, batched: bool):
    """Decode steps on the GEMV (int8 activations), of one row or of three: at each position of the
    output, given the tokens before it, the reference's greedy token is the one decoded (the reference
    runs teacher-forced through its prompt logprobs; a forced request's own token would come from a
    prefill step instead)."""
    llm = LLM(model=str(quantized_gguf), dtype="float32", num_kv_blocks=48, quantization="auto")
    reference = LLM(model=str(quantized_gguf), dtype="float32", num_kv_blocks=48, quantization="none")
    if batched:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    else:
        outputs = [llm.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    agree = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        entries = reference.generate([prompt + output], params)[0].prompt_logprobs[len(prompt) :]
        agree += sum(entry.top[0][0] == token for entry, token in zip(entries, output, strict=True))
    agreement = agree / (len(PROMPTS) * NEW_TOKENS)
    print(f"agreement of {'batched' if batched else 'batch-1'} decoding with the reference {agreement:.3f}")
    assert agreement >= MIN_GEMV_AGREEMENT


def test_the_compiled_decode_step_multiplies_fused_parts_one_by_one(quantized_gguf):
    """Decode steps as one compiled call (kernels/cpu/decode_layers.cpp) over the mixed fused parts, a
    product per part, columns concatenated and gate|up gated after, as StackedQuantizedLinear runs them:
    the Python layer loop's tokens, one row and three rows per step."""
    llm = LLM(
        model=str(quantized_gguf), dtype="float32", num_kv_blocks=48, quantization="auto", enable_prefix_caching=False
    )
    step = llm.engine.model.compiled_decode
    assert step is not None and max(step.decode_model.parts) == 2
    runs = {}
    for compiled in (True, False):
        llm.engine.runner.compiled_decode = compiled
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            alone = [llm.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]
            batched = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        runs[compiled] = (alone, batched, any(e.key == "kvserve::decode_layers" for e in prof.key_averages()))
    assert runs[True][2] and not runs[False][2]
    assert runs[True][:2] == runs[False][:2]
