"""What routing does to prefix-cache hit rate and load balance as replicas grow: a simulation.

The workload is the bench's shared-prefix generator (documents asked several questions each, spread
over tenants with their own cache salt), tokenized by the bundled model's tokenizer and hashed into
blocks with the engine's own chained block hashes. Each replica keeps an LRU cache of
--cache-blocks blocks; a request hits the longest run of its leading blocks that replica holds (prefix
caching semantics), then inserts the rest. Requests are routed by the real `Router` (routing.py) under
each policy, with the in-flight counts it would see: a request occupies its replica from arrival for
prefill_s_per_token x uncached prompt tokens + decode_s_per_token x output tokens (a model with ample
batch capacity: replicas do not slow down when loaded; load here is what the router balances).

Simplifications, all favouring no policy: blocks enter the cache at arrival (no prefill delay) and a
block in use can be evicted. Figures per (replicas, policy):
- hit rate: prompt blocks served from cache / prompt blocks looked up (the engine's block hit rate);
- work max/mean: the busiest replica's work (uncached prefill + decode seconds) over the mean;
- peak in-flight: the most requests any replica held at once.

    python benchmarks/routing_simulation.py                       # the table in docs/scaling.md
    python benchmarks/routing_simulation.py --replicas 2 4 --docs 32

Writes benchmarks/results/routing_simulation.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.generators import LengthDist, shared_prefix_workload
from kvserve.engine.prefix_cache import CacheKey, extend_block_hashes
from kvserve.model.registry import load_tokenizer
from kvserve.server.routing import Router, RoutingConfig, routing_key

ROOT = Path(__file__).resolve().parents[1]
# (label, routing config); the unbounded and tight variants show what the load bound trades.
POLICIES = (
    ("random", RoutingConfig(policy="random")),
    ("round-robin", RoutingConfig(policy="round_robin")),
    ("least-loaded", RoutingConfig(policy="least_loaded")),
    ("affinity, unbounded", RoutingConfig(load_factor=1e9)),
    ("affinity, bounded (default)", RoutingConfig()),
    ("affinity, tight bound", RoutingConfig(load_factor=1.1, load_slack=1)),
)


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    blocks: tuple[bytes, ...]  # chained hashes of the prompt's full blocks
    prompt_tokens: int
    output_tokens: int
    key: bytes


class LRUBlocks:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, blocks: tuple[bytes, ...]) -> int:
        """Leading blocks already cached (the hits); every block of the prompt is most recent afterwards."""
        hits = 0
        while hits < len(blocks) and blocks[hits] in self.blocks:
            hits += 1
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hits


def build_requests(args: argparse.Namespace) -> list[SimRequest]:
    workload = shared_prefix_workload(
        num_docs=args.docs,
        questions_per_doc=args.questions,
        rate=args.rate,
        output_len=LengthDist.parse(args.output_len),
        num_tenants=args.tenants,
        doc_words=args.doc_words,
        seed=args.seed,
    )
    tokenizer = load_tokenizer(args.model)
    requests = []
    for r in workload:
        ids = tokenizer.encode(r.prompt, add_special_tokens=True)
        hashes: list[bytes] = []
        digest = CacheKey(model_fingerprint="", cache_salt=r.cache_salt).digest()
        extend_block_hashes(hashes, ids, len(ids) // args.block_size, args.block_size, digest)
        key = routing_key(ids, r.cache_salt, args.block_size, RoutingConfig().prefix_blocks)
        requests.append(SimRequest(r.arrival_ms / 1000, tuple(hashes), len(ids), r.max_tokens, key))
    return requests


def simulate(requests: list[SimRequest], replicas: int, config: RoutingConfig, args: argparse.Namespace) -> dict:
    names = [f"engine-{i}" for i in range(replicas)]
    router = Router(config, names)
    caches = {name: LRUBlocks(args.cache_blocks) for name in names}
    in_flight = dict.fromkeys(names, 0)
    peak = dict.fromkeys(names, 0)
    work = dict.fromkeys(names, 0.0)
    finishing: list[tuple[float, str]] = []  # (finish time, replica), a heap
    hits = lookups = 0
    for r in requests:
        while finishing and finishing[0][0] <= r.arrival_s:
            in_flight[heapq.heappop(finishing)[1]] -= 1
        name = router.choose(r.key, in_flight)
        hit = caches[name].lookup_and_insert(r.blocks)
        hits += hit
        lookups += len(r.blocks)
        uncached = r.prompt_tokens - hit * args.block_size
        seconds = uncached * args.prefill_s_per_token + r.output_tokens * args.decode_s_per_token
        work[name] += seconds
        in_flight[name] += 1
        peak[name] = max(peak[name], in_flight[name])
        heapq.heappush(finishing, (r.arrival_s + seconds, name))
    mean_work = sum(work.values()) / replicas
    return {
        "hit_rate": hits / lookups,
        "work_max_over_mean": max(work.values()) / mean_work,
        "peak_in_flight": max(peak.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--questions", type=int, default=16, help="questions per document")
    # Not a divisor of the replica counts: the generator assigns tenants round-robin, which would otherwise
    # hand round-robin routing a tenant-partitioned (salt-partitioned) key space by accident.
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--doc-words", type=int, default=300)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (Poisson)")
    parser.add_argument("--output-len", default="uniform:16:128")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=1024, help="KV blocks per replica")
    parser.add_argument("--prefill-s-per-token", type=float, default=2e-4)
    parser.add_argument("--decode-s-per-token", type=float, default=0.02)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer makes the blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "routing_simulation.json")
    args = parser.parse_args()

    requests = build_requests(args)
    prompt_blocks = sum(len(r.blocks) for r in requests)
    distinct = len({b for r in requests for b in r.blocks})
    print(
        f"{len(requests)} requests, {prompt_blocks} prompt blocks ({distinct} distinct), "
        f"{args.cache_blocks} cache blocks per replica\n"
    )
    rows = []
    print("| replicas | policy | hit rate | work max/mean | peak in-flight on one replica |")
    print("|---:|---|---:|---:|---:|")
    for replicas in args.replicas:
        # With one replica every policy makes the same choice.
        for label, config in POLICIES if replicas > 1 else [("any", RoutingConfig())]:
            result = simulate(requests, replicas, config, args)
            rows.append({"replicas": replicas, "policy": label, **result})
            print(
                f"| {replicas} | {label} | {result['hit_rate']:.3f} | {result['work_max_over_mean']:.2f} "
                f"| {result['peak_in_flight']} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"settings": settings, "requests": len(requests), "distinct_blocks": distinct, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
