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

The GEMM rate: bf16 where the path multiplies bf16 natively and the weights are dense bf16, float32
otherwise (without native bf16 kvserve multiplies bf16 weights widened to float32; quantized blocks are
dequantized to float32 tiles).
"""

from __future__ import annotations

import statistics
from typing import Any

from kvserve.model.decode_cost import DecodeCost


def gemm_rate(roofs: dict[str, Any], dtype: str, quantized: bool) -> tuple[float, str]:
    """The GEMM FLOP/s a row's products can reach on this path, and which roof it is ("bf16", "fp32")."""
    if dtype == "bfloat16" and roofs["native_bf16"] and not quantized:
        return roofs["gemm_bf16"]["flop_s"], "bf16"
    return roofs["gemm_fp32"]["flop_s"], "fp32"


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
    """{output_tok_s, bound} of `requests` requests of `prompt_len` / `output_len` tokens served at once."""
    stream = roofs["stream_huge"]["gb_s"] * 1e9
    decode_contexts = range(prompt_len + 1, prompt_len + output_len)
    reads = cost.weight_bytes + sum(cost.step_bytes([n] * requests) for n in decode_contexts)
    prompt = sum(cost.token_flops(n, lm_head=n == prompt_len) for n in range(1, prompt_len + 1))
    flops = requests * (prompt + sum(cost.token_flops(n) for n in decode_contexts))
    memory, compute = reads / stream, flops / gemm
    return {
        "output_tok_s": requests * output_len / max(memory, compute),
        "bound": "memory" if memory >= compute else "compute",
    }
