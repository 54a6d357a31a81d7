"""The roof of each row benchmarks/cpu_performance.py measures: the best a row could do on this machine's
roofs (roofs.py, measured in the same run on the path kvserve ran) given what the model costs
(kvserve/model/decode_cost.py), and the row's share of it. A roofline: a step, or a whole batch, takes at
least its bytes over the stream bandwidth (huge pages, as kvserve's weights and K/V sit) and at least its
FLOPs over the GEMM rate, whichever is longer.

- Batch-1 decode: TPOT roof = the mean over the measured steps (contexts prompt+1 .. prompt+output-1) of
  max(step bytes / stream, token FLOPs / GEMM); share = TPOT roof / measured TPOT (p50).
- A batch of requests served at once (offline 64 x 128/128, served 100 x 128/128): every request in one
  batch, so the weights are read once per step (the prompts' step, then each decode step); the FLOPs are
  every token's the batch computes, prompts included (their attention too; the LM head only where logits
  are sampled). Roof tok/s = output tokens / max(bytes / stream, FLOPs / GEMM); share = measured / roof.
- Poisson arrivals have no single batch, so no roof.

Every engine's row is measured against its own bytes and FLOPs (`Weights`: how it holds the model): a peer
reading a Q4_1 GGUF reads a third of what kvserve's bf16 weights take, so the roof of one is no roof of the
other. A peer whose weights are not known has no roof (its share is n/a), never kvserve's.

The GEMM rate: where the path multiplies bf16 natively and the activations are bf16 (dense bf16 weights,
or GGUF blocks dequantized to bf16 panels: quant_linear_bf16.cpp), the higher of the bf16 and float32
rates, since bf16 operands widen to float32 exactly and kvserve takes whichever its probe finds faster
(kvserve/model/linear.py: batched_products; on Intel without AMX the float32 FMAs win); float32
otherwise (without native bf16 kvserve widens bf16 to float32 and dequantizes blocks to float32 tiles; a
peer holding its weights in float32 or GGUF blocks cannot multiply faster than the float32 rate either).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.engine.platform import keeps_quantized
from kvserve.model.decode_cost import DecodeCost
from kvserve.model.registry import load_model


@dataclass(frozen=True)
class Weights:
    """How an engine holds the model, as far as its roof goes: its dense tensors' dtype, whether its
    matrices stay in their GGUF blocks, and its K/V cache's dtype."""

    dtype: str  # a torch dtype's name: "bfloat16", "float32"
    quantized: bool
    kv_dtype: str


# A peer's weights by the name --peer-weights takes. gguf: the GGUF file's tensors as stored (its matrices
# in their blocks, its norms float32, as the file holds them) with a 16-bit K/V cache, as llama.cpp runs it
# (f16 K/V by default) and as kvserve --quantization auto does (its K/V in its dtype, bf16 by default).
PEER_WEIGHTS = {
    "bf16": Weights("bfloat16", False, "bfloat16"),
    "fp32": Weights("float32", False, "float32"),
    "gguf": Weights("float32", True, "float16"),
}


def kvserve_weights(dtype: str, quantization: str) -> Weights:
    """kvserve's weights at `dtype` and `quantization` (as serve's --quantization), on this CPU."""
    return Weights(dtype, keeps_quantized(quantization, torch.device("cpu")), dtype)


def model_cost(model: str, weights: Weights) -> DecodeCost:
    """What decoding costs `model` held as `weights` (model/decode_cost.py), from its loaded weights."""
    loaded = load_model(model)
    dtype = getattr(torch, weights.dtype)
    held = loaded.load_weights(dtype, weights.quantized).to(dtype, torch.device("cpu"))
    return DecodeCost.of(held, loaded.config, getattr(torch, weights.kv_dtype))


def gemm_rate(roofs: dict[str, Any], weights: Weights) -> tuple[float, str]:
    """The GEMM FLOP/s products of `weights` can reach on this path, and which roof it is ("bf16", "fp32")."""
    fp32 = roofs["gemm_fp32"]["flop_s"]
    if weights.dtype == "bfloat16" and roofs["native_bf16"] and roofs["gemm_bf16"]["flop_s"] > fp32:
        return roofs["gemm_bf16"]["flop_s"], "bf16"
    return fp32, "fp32"


def batch1_roof(cost: DecodeCost, roofs: dict[str, Any], gemm: float, prompt_len: int, output_len: int) -> dict:
    """{tpot_ms, bound} of batch-1 decode after a `prompt_len` prompt, over `output_len` outputs."""
    stream = roofs["stream_huge"]["gb_s"] * 1e9
    contexts = range(prompt_len + 1, prompt_len + output_len)
    memory = statistics.fmean(cost.step_bytes([n]) / stream for n in contexts)
    compute = statistics.fmean(cost.token_flops(n) / gemm for n in contexts)
    return {"tpot_ms": 1000 * max(memory, compute), "bound": "memory" if memory >= compute else "compute"}


def batch_roof(
    cost: DecodeCost, roofs: dict[str, Any], gemm: float, requests: int, prompt_len: int, output_len: int
) -> dict:
    """{output_tok_s, bound, memory_tok_s, compute_tok_s} of `requests` requests of `prompt_len` /
    `output_len` tokens served at once: the roofline, which side binds, and each side's own roof (memory:
    the step-bytes roof)."""
    stream = roofs["stream_huge"]["gb_s"] * 1e9
    decode_contexts = range(prompt_len + 1, prompt_len + output_len)
    reads = cost.weight_bytes + sum(cost.step_bytes([n] * requests) for n in decode_contexts)
    prompt = sum(cost.token_flops(n, lm_head=n == prompt_len) for n in range(1, prompt_len + 1))
    flops = requests * (prompt + sum(cost.token_flops(n) for n in decode_contexts))
    memory, compute = reads / stream, flops / gemm
    return {
        "output_tok_s": requests * output_len / max(memory, compute),
        "bound": "memory" if memory >= compute else "compute",
        "memory_tok_s": requests * output_len / memory,
        "compute_tok_s": requests * output_len / compute,
    }
