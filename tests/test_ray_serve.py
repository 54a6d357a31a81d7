"""kvserve on Ray Serve: a local Ray cluster on 127.0.0.1, two replicas of the bundled model behind the
prefix-affinity ingress, driven by the official `openai` client with a shared-prefix workload.

Checks: answers equal the offline engine's greedy answers; the prefix-cache hit rate with affinity
routing is at least the single engine's and clearly above random routing's; killing a replica
mid-run loses no request that had not started streaming, and Serve brings the replica back.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, EngineConfig, SamplingParams
from kvserve.bench.generators import LengthDist, shared_prefix_workload
from kvserve.bench.workload import WorkloadRequest

ray = pytest.importorskip(
    "ray", reason="Ray is not installed; the Ray Serve deployment needs: pip install 'kvserve[ray]'"
)
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvserve[ray]'")

from kvserve.server.ray_app import APP_NAME, RayServeConfig, build_ray_app  # noqa: E402
from kvserve.server.routing import RoutingConfig  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
# Two sequences at a time per replica: later requests wait in the engine's queue, not started, which
# is what the replica-kill check needs. One torch thread each: the two replicas share two cores.
ENGINE = EngineConfig(dtype="float32", num_kv_blocks=256, max_num_seqs=2, num_threads=1)
WORKLOAD = shared_prefix_workload(
    num_docs=4, questions_per_doc=4, rate=math.inf, output_len=LengthDist.parse("8"), doc_words=60, seed=0
)
# One request at a time: the seeded random router then makes the same choices on every run.
CONCURRENCY = 1


def waves(requests: list[WorkloadRequest]) -> tuple[list[WorkloadRequest], list[WorkloadRequest]]:
    """First question of each document (they fill the caches), then the rest (they can hit)."""
    first: dict[str, WorkloadRequest] = {}
    for r in requests:
        first.setdefault(r.id.split("q")[0], r)
    return list(first.values()), [r for r in requests if r not in first.values()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def engine_counters(base_url: str) -> tuple[float, float, float]:
    """(prefix-cache block hits, block queries, generated tokens), summed over the replicas."""
    m = scrape(base_url)
    names = ("kvserve_prefix_cache_hits_total", "kvserve_prefix_cache_queries_total", "kvserve_generated_tokens_total")
    hits, queries, generated = (m.get((name, frozenset()), 0.0) for name in names)
    return hits, queries, generated


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 << 20,
        _node_ip_address="127.0.0.1",
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = RayServeConfig(num_replicas=2, replica_num_cpus=1, health_check_period_s=1)
        serve.run(build_ray_app(ENGINE, config), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def set_policy(policy: str) -> None:
    serve.get_app_handle(APP_NAME).set_routing.remote(RoutingConfig(policy=policy)).result()


async def complete_all(base_url: str, requests: list[WorkloadRequest], salt: str) -> tuple[list[str], int]:
    """Texts in request order and the completion tokens they took, CONCURRENCY requests at a time."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(r: WorkloadRequest) -> tuple[str, int]:
        async with limit:
            got = await client.completions.create(
                model=MODEL, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0, extra_body={"cache_salt": salt}
            )
            return got.choices[0].text, got.usage.completion_tokens

    results = await asyncio.gather(*(one(r) for r in requests))
    await client.close()
    return [text for text, _ in results], sum(tokens for _, tokens in results)


def http_run(base_url: str, salt: str) -> tuple[list[str], float]:
    """Both waves through the ingress; answers in WORKLOAD order and the block hit rate they caused."""
    first, rest = waves(WORKLOAD)
    hits0, queries0, generated0 = engine_counters(base_url)
    texts_first, tokens_first = asyncio.run(complete_all(base_url, first, salt))
    texts_rest, tokens_rest = asyncio.run(complete_all(base_url, rest, salt))
    # The ingress reads replica stats by periodic probes: wait until they cover every token generated.
    deadline = time.monotonic() + 60
    while (counters := engine_counters(base_url))[2] - generated0 < tokens_first + tokens_rest:
        assert time.monotonic() < deadline, "replica stats never caught up"
        time.sleep(0.3)
    hits, queries = counters[0] - hits0, counters[1] - queries0
    by_id = dict(zip([r.id for r in first + rest], texts_first + texts_rest, strict=True))
    return [by_id[r.id] for r in WORKLOAD], hits / queries


def offline_run(llm: LLM) -> tuple[list[str], float]:
    """The same waves on one engine: the reference answers and the single-replica hit rate."""
    before = llm.engine.stats()
    by_id = {}
    for wave in waves(WORKLOAD):
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in wave]
        for r, out in zip(wave, llm.generate([r.prompt for r in wave], params, cache_salt="single"), strict=True):
            by_id[r.id] = out.text
    after = llm.engine.stats()
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return [by_id[r.id] for r in WORKLOAD], hits / queries


def test_affinity_routing_keeps_answers_and_hit_rate(cluster: str, llm_fp32: LLM) -> None:
    expected, single_rate = offline_run(llm_fp32)
    set_policy("prefix_affinity")
    affinity_answers, affinity_rate = http_run(cluster, salt="affinity")
    set_policy("random")
    try:
        random_answers, random_rate = http_run(cluster, salt="random")  # a fresh salt: cold caches again
    finally:
        set_policy("prefix_affinity")
    print(
        f"\nprefix-cache block hit rate: single engine {single_rate:.3f}, "
        f"2 replicas prefix-affinity {affinity_rate:.3f}, 2 replicas random {random_rate:.3f}"
    )
    assert affinity_answers == expected
    assert random_answers == expected
    assert affinity_rate >= single_rate - 1e-9
    assert random_rate < affinity_rate - 0.05


@dataclass
class StreamResult:
    text: str = ""
    started: bool = False  # a chunk with text arrived (before any error)
    error: str | None = None


def kill_busiest_replica(base_url: str) -> str:
    """ray.kill the actor of the replica with the most requests in flight; Serve starts a new one."""
    m = scrape(base_url)
    in_flight = {
        dict(labels)["replica"]: value
        for (name, labels), value in m.items()
        if name == "kvserve_replica_routed_in_flight"
    }
    victim = max(in_flight, key=in_flight.__getitem__)
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{victim}#" in a["name"]]
    assert len(actors) == 1, actors
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    return victim


async def stream_and_kill(base_url: str, prompts: list[str], max_tokens: int) -> tuple[list[StreamResult], str]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    results = [StreamResult() for _ in prompts]
    first_token = asyncio.Event()

    async def one(prompt: str, result: StreamResult) -> None:
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"cache_salt": "kill", "ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    result.started = True
                    result.text += chunk.choices[0].text
                    first_token.set()
        except openai.APIError as exc:
            result.error = str(exc)

    tasks = [asyncio.ensure_future(one(p, r)) for p, r in zip(prompts, results, strict=True)]
    await first_token.wait()
    victim = await asyncio.to_thread(kill_busiest_replica, base_url)
    await asyncio.gather(*tasks)
    await client.close()
    return results, victim


def test_killing_a_replica_loses_no_request_that_had_not_started(cluster: str, llm_fp32: LLM) -> None:
    # One document: every request has the same affinity key, so one replica holds them all, two
    # decoding and the rest waiting in its queue when it is killed.
    doc_questions = [r.prompt for r in WORKLOAD if r.id.startswith("d0q")]
    prompts = (doc_questions * 2)[:8]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [out.text for out in llm_fp32.generate(prompts, params)]
    retries_before = scrape(cluster).get(("kvserve_router_retries_total", frozenset()), 0.0)

    results, victim = asyncio.run(stream_and_kill(cluster, prompts, max_tokens=24))

    failed = [r for r in results if r.error is not None]
    print(f"\nkilled {victim}: {len(results) - len(failed)} of {len(results)} requests completed; failures: {failed}")
    for result, want in zip(results, expected, strict=True):
        if result.error is None:
            assert result.text == want
        else:  # only a request that had already streamed text may fail, and it says why
            assert result.started, result.error
            assert "replica" in result.error
    retries = scrape(cluster).get(("kvserve_router_retries_total", frozenset()), 0.0) - retries_before
    assert retries >= 1, "the kill should have caught requests that were still queued"

    # Serve replaces the dead replica; the ingress routes to it again once it answers a probe.
    deadline = time.monotonic() + 180
    healthy_series = ("kvserve_replica_healthy", frozenset({("replica", victim)}))
    while scrape(cluster).get(healthy_series) != 1.0:
        assert time.monotonic() < deadline, f"{victim} did not come back"
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=300)
    extra = {"cache_salt": "kill", "ignore_eos": True}  # the same key: routed to the restarted replica
    got = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0, extra_body=extra)
    assert got.choices[0].text == expected[0]
