"""Load time and peak RSS of loading a model's weights in a serving dtype, each in a fresh process.

    python benchmarks/load_memory.py --model smollm2-135m-instruct gemma3-270m --dtype bfloat16 float32
    python benchmarks/load_memory.py --kvserve-root /tmp/old-tree   # an older kvserve, for before/after

The issue's budget: peak RSS while loading <= 1.25 x the final weights' bytes + 300 MB. The child reports
its own VmHWM (cpu_performance.py reads the same field for the server), the RSS of a bare `import torch,
kvserve` beside it (peak_over_import_mb: the loading's own), and the bytes of the distinct weight tensors
it ends with. The tokenizer is loaded too: it is part of loading a model.
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
model, dtype = sys.argv[1], getattr(torch, sys.argv[2])
start = time.perf_counter()
loaded = registry.load_model(model)
if hasattr(loaded, "load_weights"):
    weights = loaded.load_weights(dtype)
else:  # before the lean loader: float32 weights, cast by the model
    weights = loaded.weights.to(dtype, torch.device("cpu"))
seconds = time.perf_counter() - start
tensors = {id(t): t for t in [weights.embed_tokens, weights.lm_head, weights.final_norm]}
for layer in weights.layers:
    tensors.update({id(t): t for t in vars(layer).values() if isinstance(t, torch.Tensor)})
weight_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
print(json.dumps({"model": model, "dtype": sys.argv[2], "load_s": round(seconds, 2), "import_rss_mb": round(base_mb),
                  "peak_rss_mb": round(status_mb("VmHWM")), "weights_mb": round(weight_mb)}))
"""


def measure(model: str, dtype: str, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "KVSERVE_CPU_KERNELS": "0"}
    # cwd: `python -c` puts it first on sys.path, ahead of PYTHONPATH.
    command = [sys.executable, "-c", _CHILD, model, dtype]
    out = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    if out.returncode:
        return {"model": model, "dtype": dtype, "error": out.stderr.strip().splitlines()[-1]}
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["budget_mb"] = round(1.25 * row["weights_mb"] + 300)
    row["peak_over_import_mb"] = row["peak_rss_mb"] - row["import_rss_mb"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--kvserve-root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    for model in args.model:
        for dtype in args.dtype:
            print(json.dumps(measure(model, dtype, args.kvserve_root)), flush=True)


if __name__ == "__main__":
    main()
