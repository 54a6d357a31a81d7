#!/usr/bin/env bash
# On a CUDA machine with triton: check both Triton attention kernels against the float64 reference
# (relative error) and time them against torch SDPA; prints a table, exits non-zero on a failure.
# Not needed on the CPU (the CPU backends are covered by tests/test_attention_*.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'" \
  || { echo "gpu_attention_check: needs CUDA and triton" >&2; exit 2; }
PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/gpu_attention_check.py "$@"
