"""Replay the travel-assistant workload with prefix caching on and off; print throughput, goodput
and cache hits side by side.

By default both runs use the in-process engine on the bundled model, prompts through the chat
template (as /v1/chat/completions would). With --url-on/--url-off they replay against two live
servers instead (e.g. `kvserve serve --port 8001` and `kvserve serve --port 8002 --no-prefix-caching`).

    python examples/travel_assistant/compare_prefix_caching.py
    python examples/travel_assistant/compare_prefix_caching.py --tenants 2 --users-per-tenant 3 --ttft-gate-ms 5000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from build_workload import add_workload_args, build

from kvserve.bench.metrics import Gates
from kvserve.bench.offline import OfflineConfig, replay_offline
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.bench.report import fmt
from kvserve.bench.results import build_results
from kvserve.bench.workload import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]


def run(caching: bool, requests: list[WorkloadRequest], args: argparse.Namespace) -> dict[str, Any]:
    url = args.url_on if caching else args.url_off
    if url:
        cfg = ReplayConfig(url, endpoint="chat", warmup=args.warmup, quiet=True)
        records, meta = replay(requests, cfg)
    else:
        cfg = OfflineConfig(enable_prefix_caching=caching, warmup=args.warmup, chat=True, quiet=True)
        records, meta = replay_offline(requests, cfg)
    return build_results(records, {**meta, "prefix_caching": caching}, gates=Gates(ttft_ms=args.ttft_gate_ms))


def first_of_each_group(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The first request (by arrival) of each (tenant, document): nothing it may reuse exists yet,
    apart from the chat template's header, so its cached tokens show any leak across tenants or
    documents."""
    seen, firsts = set(), []
    for rec in sorted(res["requests"], key=lambda r: r["arrival"]):
        group = (rec["tenant"], rec["id"].rsplit("-", 1)[-1])
        if group not in seen:
            seen.add(group)
            firsts.append(rec)
    return firsts


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    reqs = res["requests"]
    good = res["goodput"]
    counters = res["meta"].get("engine_counters", {})
    firsts = first_of_each_group(res)
    later = [r for r in reqs if r not in firsts and r["cached_tokens"] is not None]
    return [
        ("completed / failed", f"{res['completed']} / {res['failed']}"),
        ("drain window (s)", fmt(res["duration"])),
        ("output tok/s (drain)", fmt(res["output_throughput"])),
        ("mean / p90 TTFT (ms)", f"{fmt(res['mean_ttft_ms'])} / {fmt(res['p90_ttft_ms'])}"),
        ("acceptable answers", f"{good['accepted']} of {good['completed_in_window']}"),
        ("gate violations", str(len(res["gates"]["violations"]))),
        ("goodput (good req/s)", fmt(res["request_goodput"])),
        ("cached prompt tokens (sum)", fmt(sum(r["cached_tokens"] or 0 for r in reqs))),
        ("prompt tokens computed (engine)", fmt(counters.get("prompt_tokens_computed"))),
        ("prefix_cache_hits (engine counter)", fmt(counters.get("prefix_cache_hits"))),
        ("first of each (tenant, doc): max cached", fmt(max((r["cached_tokens"] or 0 for r in firsts), default=None))),
        ("later requests: mean cached", fmt(sum(r["cached_tokens"] for r in later) / len(later) if later else None)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ttft-gate-ms", type=float, help="hard TTFT bound for goodput")
    parser.add_argument("--url-on", help="live server with prefix caching on (else the offline engine)")
    parser.add_argument("--url-off", help="live server with prefix caching off (else the offline engine)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    requests = build(args.tenants, args.users_per_tenant, args.rate, args.max_tokens, args.seed)
    on, off = run(True, requests, args), run(False, requests, args)
    print(f"travel assistant: {len(requests)} requests, {args.tenants} tenants, chat prompts, warmup {args.warmup}")
    width = max(len(name) for name, _ in rows(on))
    print(f"{'':{width}}  {'prefix caching on':>20}  {'prefix caching off':>20}")
    for (name, a), (_, b) in zip(rows(on), rows(off), strict=True):
        print(f"{name:{width}}  {a:>20}  {b:>20}")
    for label, res in (("on", on), ("off", off)):
        rejected = res["goodput"]["rejected_ids"]
        if rejected:
            print(f"caching {label}: rejected by the contract: {', '.join(rejected)}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"travel_assistant-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"caching_on": on, "caching_off": off}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
