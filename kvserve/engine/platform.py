"""What the engine runs on: the device, the dtype that pays there, and whether GGUF weights stay quantized.

Each answer follows from the config and what this machine has (CUDA, the CPU's instruction-set path, the
kernels that built), so the engine asks here rather than probing the machine itself.
"""

from __future__ import annotations

import logging

import torch

from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model import linear
from kvserve.model.quantized_linear import quantized_kernels

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if bf16_pays_on_cpu() else torch.float32


def bf16_pays_on_cpu() -> bool:
    """Whether bf16 runs at least as fast as float32 here. With native support (AVX512-BF16 / AMX) it is
    faster everywhere. Without it, on AVX2 CPUs, kvserve's GEMV decodes batch 1 reading half the bytes
    and oneDNN multiplies batches over the weights widened to float32, at float32's speed; bf16 also
    halves the KV cache. Figures: benchmarks/RESULTS.md, "Figures behind the code's rules"."""
    if torch.backends.mkldnn.is_available() and cpu_has_bf16():
        return True
    return linear.gemv_kernels() is not None and linear.onednn_packing_works(torch.float32)


def cpu_has_bf16() -> bool:
    """Native bf16 products on the selected instruction-set path: a forced lower path (KVSERVE_CPU_ISA)
    decides as a CPU without them would."""
    return cpu_isa.selected().bf16


def keeps_quantized(quantization: str, device: torch.device) -> bool:
    """Whether GGUF weights stay in their blocks: `--quantization auto` where the quantized kernels run."""
    if quantization == "none":
        return False
    if device.type == "cpu" and quantized_kernels() is not None:
        return True
    logger.warning("--quantization auto: no quantized kernels on %s here; every weight is dequantized", device)
    return False
