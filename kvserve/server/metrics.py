"""Prometheus metrics of one app: request outcomes and latency histograms, plus the engine's state.

Latencies use the engine's own timestamps (one perf_counter clock, DESIGN.md): TTFT = first token -
arrival, queue time = first scheduled - arrival, E2E = finished - arrival, ITL = each gap between
emissions, TPOT = (last - first emission) / (outputs - 1), observed only for two or more outputs.
Engine gauges are read from the engine loop's latest stats snapshot at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.outputs import RequestOutput
from kvserve.server.engine_client import EngineClient

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# engine stats key -> (metric name, kind, help). Keys the engine does not report are skipped.
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "num_running": ("kvserve_requests_running", "gauge", "Sequences in the running batch (n>1 counts each sample)"),
    "num_waiting": ("kvserve_requests_waiting", "gauge", "Sequences waiting for admission"),
    "in_flight_streams": ("kvserve_requests_in_flight", "gauge", "HTTP requests admitted and not yet answered"),
    "kv_blocks_total": ("kvserve_kv_blocks_total", "gauge", "KV cache blocks in the pool"),
    "kv_blocks_used": ("kvserve_kv_blocks_used", "gauge", "KV cache blocks held by sequences"),
    "kv_blocks_free": ("kvserve_kv_blocks_free", "gauge", "KV cache blocks free (cached-but-unused included)"),
    "prefix_cache_hit_rate": ("kvserve_prefix_cache_hit_rate", "gauge", "Prefix cache block hits / queries"),
    "prefix_cache_queries": ("kvserve_prefix_cache_queries", "counter", "Prefix cache block lookups"),
    "prefix_cache_hits": ("kvserve_prefix_cache_hits", "counter", "Prefix cache block hits"),
    "spec_acceptance_rate": ("kvserve_spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens"),
    "spec_proposed_tokens": ("kvserve_spec_proposed_tokens", "counter", "Draft tokens proposed"),
    "spec_accepted_tokens": ("kvserve_spec_accepted_tokens", "counter", "Draft tokens accepted"),
    "spec_mean_tokens_per_step": ("kvserve_spec_tokens_per_step", "gauge", "Tokens emitted per verification"),
    "last_batch_size": ("kvserve_batch_size", "gauge", "Sequences in the latest iteration"),
    "max_batch_size": ("kvserve_batch_size_max", "gauge", "Largest number of sequences in one iteration"),
    "mean_batch_size": ("kvserve_batch_size_mean", "gauge", "Mean sequences per iteration"),
    "last_batch_tokens": ("kvserve_iteration_tokens", "gauge", "Tokens fed to the model in the latest iteration"),
    "steps": ("kvserve_iterations", "counter", "Engine iterations (forward passes)"),
    "prompt_tokens_computed": ("kvserve_prompt_tokens_computed", "counter", "Prompt tokens prefilled (hits excluded)"),
    "generated_tokens": ("kvserve_generated_tokens", "counter", "Tokens generated"),
    "preemptions": ("kvserve_preemptions", "counter", "Sequences preempted for lack of KV blocks"),
    "row_block_deferrals": ("kvserve_row_block_deferrals", "counter", "Decode tokens put off a step (row blocks)"),
    "structured_truncated": (
        "kvserve_structured_output_truncated",
        "counter",
        "Constrained samples cut by max_tokens before their value was complete (finish_reason length)",
    ),
    "step_failures": ("kvserve_step_failures", "counter", "Iterations that raised (their requests failed)"),
    # Reported only by the router in front of several replicas (ray_client.py).
    "replicas_healthy": ("kvserve_replicas_healthy", "gauge", "Engine replicas answering health probes"),
    "router_retries": ("kvserve_router_retries", "counter", "Requests re-sent to another replica before any token"),
}


class _EngineCollector(Collector):
    def __init__(self, async_engine: EngineClient) -> None:
        self.async_engine = async_engine

    def collect(self) -> Iterator[Metric]:
        stats = self.async_engine.stats()
        for key, (name, kind, doc) in ENGINE_METRICS.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                yield family(name, doc, value=value)
        healthy = self.async_engine.error is None
        yield GaugeMetricFamily("kvserve_engine_healthy", "1 while the engine loop runs", value=int(healthy))
        yield GaugeMetricFamily("kvserve_draining", "1 while shutting down", value=int(self.async_engine.draining))


class ServerMetrics:
    def __init__(self, async_engine: EngineClient) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "kvserve_http_requests",
            "Generation requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.finish_reasons = Counter(
            "kvserve_finished_sequences", "Finished samples by finish reason", ["reason"], registry=registry
        )
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.completion_tokens = Counter(
            "kvserve_completion_tokens", "Completion tokens of finished requests", registry=registry
        )
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.tpot = Histogram(
            "kvserve_time_per_output_token_seconds",
            "(last - first emission) / (outputs - 1)",
            buckets=_TOKEN_GAP_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Gap between consecutive emissions",
            buckets=_TOKEN_GAP_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.queue_time = Histogram(
            "kvserve_request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineCollector(async_engine))

    def observe_finished(self, output: RequestOutput) -> None:
        """Latencies and token counts of one finished engine request."""
        m = output.metrics
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        times = output.outputs[0].token_times if output.outputs else []
        for earlier, later in zip(times, times[1:], strict=False):
            self.itl.observe(later - earlier)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        for completion in output.outputs:
            self.finish_reasons.labels(completion.finish_reason or "none").inc()
            self.completion_tokens.inc(len(completion.token_ids))
        self.prompt_tokens.inc(len(output.prompt_token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)
