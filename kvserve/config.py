"""Engine configuration: every limit has a name, a default and a start-up check with a clear message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none")
# What `kvserve serve` (every CLI command) keeps in blocks unless told: on the bundled Q4_1 SmolLM2 it
# serves batch 1 in about half bf16's time and Poisson arrivals with lower latencies, with a third of the
# weight bytes. All at once it is faster than bf16 on AVX-512 with VNNI and no AMX, within a few percent
# on AVX2, slower on an AMX Xeon, where dense bf16 batches run on AMX tiles (benchmarks/RESULTS.md,
# "Sixteen rows per vector", "Default quantization", "Quantized batches on native bf16"); there
# `--quantization none` serves the batched peak.
CLI_QUANTIZATION = "auto"
# The attention backends by name (kernels/backends.py); "auto" picks one for the device.
BACKEND_NAMES = ("auto_cpu", "cpu", "tiled", "reference", "sdpa", "triton")
ATTENTION_BACKENDS = ("auto", *BACKEND_NAMES)


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    # "auto" picks bfloat16 where the device has fast bf16 matrix units, else float32.
    dtype: str = "auto"
    # "auto": GGUF weights of a block type kvserve's quantized CPU kernels multiply (Q8_0, Q4_0, Q4_1,
    # Q5_0, Q4_K, Q6_K) stay in their blocks, where those kernels run; "none": every weight dequantized
    # to `dtype` at load.
    # The library's default is "none" (its greedy tokens then do not depend on the batch: the batch-1 GEMV
    # quantizes activations to int8, the panel product of 3+ rows does not); the CLI's is CLI_QUANTIZATION.
    quantization: str = "none"
    # "auto" is cuda when present, else cpu. Nothing below hard-codes a device.
    device: str = "auto"
    block_size: int = 16
    # The KV pool is sized by num_kv_blocks when given, else by kv_cache_memory_bytes.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # Longest prompt + output a request may have; None means the model's context length.
    max_model_len: int | None = None
    # Requests waiting for admission beyond this are refused (HTTP 429) instead of queueing forever.
    max_waiting_requests: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    # e.g. {"method": "ngram", "num_tokens": 4} or {"method": "draft", "num_tokens": 3, "draft_layers": 12}
    speculative: dict[str, Any] | None = None
    # Seeds the generators of requests that bring no seed of their own.
    seed: int = 0
    # Parallel samples (SamplingParams.n) allowed per request.
    max_n: int = 16
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        positive = {
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_waiting_requests": self.max_waiting_requests,
            "max_n": self.max_n,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.speculative is not None and not isinstance(self.speculative, dict):
            raise ValueError("speculative must be a dict like {'method': 'ngram', 'num_tokens': 4}")
