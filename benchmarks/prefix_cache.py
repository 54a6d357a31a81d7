"""Prefix caching on vs off on one shared-prefix workload, both runs in one invocation (book §31.3).

Every request is the same document (seeded random token ids) followed by a question unique to it; all
arrive at time 0, decode greedily and emit exactly --output-tokens tokens (ignore_eos), so both runs do
the same generation work. Both use the in-process engine (`kvserve bench offline`'s replay) with the same
dtype, one warm-up request each, excluded. Requests admitted in the first step, while the document is
still being computed, cannot hit; the rest reuse its blocks.

Per run: prompt tokens the engine computed (engine counter `prompt_tokens_computed`, hits excluded),
median TTFT (first token - arrival, from RequestOutput.metrics), total time (arrival to last token), and
the hit rate (prompt tokens served from the cache / prompt tokens looked up); then on/off ratios.

    python benchmarks/prefix_cache.py                   # 64 x (1,024 + 32) prompt tokens, 64 out, dtype auto
    python benchmarks/prefix_cache.py --requests 16 --doc-tokens 256 --question-tokens 16 --output-tokens 8

Writes benchmarks/results/prefix_cache.json (figures plus both runs' results in full).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from kvserve.bench.offline import OfflineConfig, replay_offline
from kvserve.bench.report import fmt
from kvserve.bench.results import build_results
from kvserve.bench.workload import SAFE_TOKEN_RANGE, WorkloadRequest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("prompt_tokens_computed", "ttft_median_s", "total_time_s", "hit_rate")


def shared_prefix_requests(args: argparse.Namespace) -> list[WorkloadRequest]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(n)]

    document = ids(args.doc_tokens)
    return [
        WorkloadRequest(
            id=f"q{i}",
            arrival_ms=0,
            input_ids=document + ids(args.question_tokens),
            max_tokens=args.output_tokens,
            ignore_eos=True,
        )
        for i in range(args.requests)
    ]


def run(caching: bool, requests: list[WorkloadRequest], args: argparse.Namespace) -> dict[str, Any]:
    cfg = OfflineConfig(dtype=args.dtype, enable_prefix_caching=caching, warmup=1, quiet=True)
    records, meta = replay_offline(requests, cfg)
    failed = [r.id for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"caching={caching}: requests failed: {failed}")
    counters = meta["engine_counters"]
    queries = counters["prefix_cache_queries"]
    figures = {
        "prompt_tokens_computed": counters["prompt_tokens_computed"],
        "ttft_median_s": statistics.median(r.token_times[0] - r.arrival for r in records),
        "total_time_s": max(r.token_times[-1] for r in records) - min(r.arrival for r in records),
        "hit_rate": counters["prefix_cache_hits"] / queries if queries else 0.0,
        "requests_with_hits": sum(1 for r in records if r.cached_tokens),
        "dtype": meta["engine_stats"]["after"]["dtype"],
    }
    return {"figures": figures, "outputs": [r.text for r in records], "results": build_results(records, meta)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=1024, help="shared document (the prefix)")
    parser.add_argument("--question-tokens", type=int, default=32, help="unique suffix of each request")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_cache.json")
    args = parser.parse_args()

    requests = shared_prefix_requests(args)
    on, off = run(True, requests, args), run(False, requests, args)
    ratios = {k: on["figures"][k] / off["figures"][k] for k in FIGURES[:3]}
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))

    print(
        f"{args.requests} requests x ({args.doc_tokens} shared + {args.question_tokens} unique) prompt tokens, "
        f"{args.output_tokens} output tokens, dtype {on['figures']['dtype']}"
    )
    print(f"{'':24}{'caching on':>14}{'caching off':>14}{'on / off':>12}")
    for key in (*FIGURES, "requests_with_hits"):
        ratio = fmt(ratios[key]) if key in ratios else ""
        print(f"{key:24}{fmt(on['figures'][key]):>14}{fmt(off['figures'][key]):>14}{ratio:>12}")
    print(f"identical greedy outputs: {same} of {args.requests}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "workload": {k: getattr(args, k) for k in ("requests", "doc_tokens", "question_tokens", "output_tokens")},
        "on": on["figures"],
        "off": off["figures"],
        "ratios_on_over_off": ratios,
        "identical_outputs": same,
        "runs": {"on": on["results"], "off": off["results"]},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
