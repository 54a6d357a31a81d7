"""Load time and peak RSS of loading a model's weights in a serving dtype, each in a fresh process.

    python benchmarks/load_memory.py --model smollm2-135m-instruct gemma3-270m --dtype bfloat16 float32
    python benchmarks/load_memory.py --model gemma3-270m --dtype bfloat16 --quantization auto
    python benchmarks/load_memory.py --kvserve-root /tmp/old-tree   # an older kvserve, for before/after

The issue's budget: peak RSS while loading <= 1.25 x the final weights' bytes + 300 MB. The child reports
its own VmHWM (cpu_performance.py reads the same field for the server), the RSS of a bare `import torch,
kvserve` beside it (peak_over_import_mb: the loading's own), and the bytes of the distinct weight tensors
it ends with (matrices kept in GGUF blocks with `--quantization auto` count their blocks' bytes). The
tokenizer is loaded too: it is part of loading a model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys, time
from pathlib import Path

def status_mb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

import torch
from kvserve.model import registry
base_mb = status_mb("VmRSS")
model, dtype, keep_quantized = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "auto"
start = time.perf_counter()
loaded = registry.load_model(model)
if keep_quantized:
    weights = loaded.load_weights(dtype, keep_quantized=True)
elif hasattr(loaded, "load_weights"):
    weights = loaded.load_weights(dtype)
else:  # before the lean loader: float32 weights, cast by the model
    weights = loaded.weights.to(dtype, torch.device("cpu"))
seconds = time.perf_counter() - start
tensors = {id(t): t for t in [weights.embed_tokens, weights.lm_head, weights.final_norm]}
for layer in weights.layers:
    tensors.update({id(t): t for t in vars(layer).values() if t is not None})
weight_mb = sum(t.nbytes for t in tensors.values()) / 2**20  # a tensor's, or a quantized one's blocks'
peak_mb = status_mb("VmHWM")
print(json.dumps({"load_s": round(seconds, 2), "import_rss_mb": round(base_mb), "peak_rss_mb": round(peak_mb),
                  "weights_mb": round(weight_mb)}))
"""


def measure(model: str, dtype: str, quantization: str, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "KVSERVE_CPU_KERNELS": "0"}
    # cwd: `python -c` puts it first on sys.path, ahead of PYTHONPATH.
    command = [sys.executable, "-c", _CHILD, model, dtype, quantization]
    out = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    case = {"model": model, "dtype": dtype, "quantization": quantization}
    if out.returncode:
        return {**case, "error": out.stderr.strip().splitlines()[-1]}
    row = {**case, **json.loads(out.stdout.strip().splitlines()[-1])}
    row["budget_mb"] = round(1.25 * row["weights_mb"] + 300)
    row["peak_over_import_mb"] = row["peak_rss_mb"] - row["import_rss_mb"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "auto"])
    parser.add_argument("--kvserve-root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    for model in args.model:
        for dtype in args.dtype:
            for quantization in args.quantization:
                print(json.dumps(measure(model, dtype, quantization, args.kvserve_root)), flush=True)


if __name__ == "__main__":
    main()
