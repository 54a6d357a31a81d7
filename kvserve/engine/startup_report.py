"""What an engine chose, as one report: model, weights, dtype, kernels, KV pool, limits.

`engine_report(engine)` builds it from the engine's real state (not from the flags), the server logs it
when it is ready (adding the listen address and the time to ready), and `kvserve info` prints it without
serving. A report is an ordered list of named rows, so a new field is one `report.add(...)` line here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvserve.intmath import div_ceil
from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.model.decode_cost import stored_bytes
from kvserve.model.linear import BATCHED_PRODUCT_ENV, batched_products
from kvserve.model.registry import load_model, resolve

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

# The CPU features the kernels' paths and the dtype choice depend on (the rest of /proc/cpuinfo's flags do not
# matter): what each path requires, and AVX512-BF16.
RELEVANT_CPU_FEATURES = tuple(dict.fromkeys([*(f for isa in build_config.ISAS for f in isa.requires), "avx512_bf16"]))


@dataclass
class StartupReport:
    rows: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, value: object) -> None:
        self.rows[name] = str(value)

    def lines(self) -> list[str]:
        width = max((len(name) for name in self.rows), default=0)
        return [f"{name + ':':<{width + 1}} {value}" for name, value in self.rows.items()]


def engine_report(engine: LLMEngine) -> StartupReport:
    config, model_config = engine.config, engine.model.config
    source = resolve(config.model)
    loaded = load_model(config.model)  # cached per process: the engine's own load, not a second one
    report = StartupReport()
    report.add("model", f"{engine.model_name} ({source.path})")
    report.add(
        "family",
        f"{loaded.architecture}: {model_config.num_layers} layers, hidden {model_config.hidden_size}, "
        f"{model_config.num_heads} heads / {model_config.num_kv_heads} KV heads, vocab {model_config.vocab_size}",
    )
    types = ", ".join(f"{name} x {count}" for name, count in loaded.tensor_types.items())
    report.add("weights", f"{source.kind}: {types}")
    report.add("dtype", f"{str(engine.dtype).removeprefix('torch.')} (--dtype {config.dtype})")
    report.add("quantization", f"matrices in GGUF blocks: {engine.quantization} (--quantization {config.quantization})")
    report.add("device", f"{engine.device}, {torch.get_num_threads()} threads")
    report.add("attention backend", f"{engine.attention_backend} (--attention-backend {config.attention_backend})")
    kernels = cpu.choice()
    report.add("cpu kernels", f"{kernels.source}: {kernels.reason}")
    report.add("cpu path", kernels.isa.describe())
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "the CPU's best")
    report.add("torch cpu ops", f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN up to {onednn}")
    batched = os.environ.get(BATCHED_PRODUCT_ENV, "auto")
    products = batched_products()
    long_chunks = ", prefill chunks too" if products.long_chunks else ""
    panels = f"; quantized panels on {products.panels} tiles" if products.panels not in (None, products.kernel) else ""
    report.add("batched bf16 products", f"{products.kernel}{long_chunks}{panels} ({BATCHED_PRODUCT_ENV}={batched})")
    report.add("compiled decode step", compiled_decode_summary(engine))
    features = set(build_config.cpu_features())
    report.add("cpu features", " ".join(f for f in RELEVANT_CPU_FEATURES if f in features) or "none of interest")
    block_size, num_blocks = engine.cache.block_size, engine.pool.num_blocks
    report.add(
        "kv pool",
        f"{num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
        f"{engine.cache.tensor.nbytes} bytes ({engine.cache.tensor.nbytes / 2**20:.1f} MiB)",
    )
    report.add("memory", memory_summary(engine))
    report.add("max sequences at full context", num_blocks // div_ceil(engine.max_model_len, block_size))
    report.add("max_model_len", f"{engine.max_model_len} tokens (model context {model_config.max_position_embeddings})")
    report.add("max_num_seqs", config.max_num_seqs)
    report.add("max_num_batched_tokens", config.max_num_batched_tokens)
    report.add("queue (max_waiting_requests)", config.max_waiting_requests)
    report.add("max_n", config.max_n)
    report.add("prefix caching", "on" if config.enable_prefix_caching else "off")
    report.add("chunked prefill", "on" if config.enable_chunked_prefill else "off")
    report.add("speculative", json.dumps(config.speculative) if config.speculative else "off")
    return report


def memory_summary(engine: LLMEngine) -> str:
    """What the weights and the KV pool hold, and the process's resident memory now and at its peak: the
    rest of it is the interpreter and libraries, packed copies of weights, and what loading left behind."""
    weights = engine.model.weights.tensors()
    blocks = sum(stored_bytes(t) for t in weights if not isinstance(t, torch.Tensor))
    dense = sum(stored_bytes(t) for t in weights if isinstance(t, torch.Tensor))
    rss, peak = process_memory_mib()
    return (
        f"weights {(blocks + dense) / 2**20:.1f} MiB ({blocks / 2**20:.1f} in GGUF blocks, {dense / 2**20:.1f} "
        f"dense), KV pool {engine.cache.tensor.nbytes / 2**20:.1f} MiB; process RSS {rss:.0f} MiB, "
        f"peak {peak:.0f} MiB"
    )


def process_memory_mib() -> tuple[float, float]:
    """This process's resident memory now and at its peak (VmRSS, VmHWM), MiB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rss_kib, peak_kib = (int(status[name].split()[0]) for name in ("VmRSS", "VmHWM"))
    return rss_kib / 1024, peak_kib / 1024


def compiled_decode_summary(engine: LLMEngine) -> str:
    """Whether steps of decode rows run as one compiled call, and if not, why."""
    if engine.model.compiled_decode is None:
        return f"no: no compiled step for {str(engine.dtype).removeprefix('torch.')} weights of this format here"
    if not engine.runner.compiled_decode:
        return f"no: attention backend {engine.attention_backend} does not run decode rows on the compiled kernel"
    return "yes"


def process_age_s() -> float:
    """Seconds since this process started, by the kernel's clock (/proc), so imports and loading count."""
    fields_after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start_ticks = int(fields_after_name[19])  # field 22, starttime: clock ticks after boot
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")


def time_since_start() -> str:
    """Wall time since the process started, and the CPU time it used (all threads): on a machine shared
    with other work the wall time stretches, the CPU time does not."""
    return f"{process_age_s():.1f} s since the process started ({time.process_time():.1f} s of CPU)"
