"""Engine stats of several replicas: one aggregate (what /metrics reports under the single-server
names) and per-replica series labelled `replica` (under kvserve_replica_* names, so no family is
exported twice)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.server.metrics import ENGINE_METRICS

# Aggregates that are not sums: ratios recomputed from summed parts, means weighted by their counts.
_RATIOS = {
    "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries"),
    "spec_acceptance_rate": ("spec_accepted_tokens", "spec_proposed_tokens"),
}
_WEIGHTED_MEANS = {"mean_batch_size": "steps", "spec_mean_tokens_per_step": "spec_steps"}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def aggregate_stats(per_replica: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counters and gauges summed, max_* maximized, ratios and means recomputed; text from the first."""
    total: dict[str, Any] = {}
    for stats in per_replica:
        for key, value in stats.items():
            if not _number(value):
                total.setdefault(key, value)
            elif key.startswith("max_"):
                total[key] = max(total.get(key, value), value)
            elif key in _WEIGHTED_MEANS:
                total[key] = total.get(key, 0.0) + value * stats.get(_WEIGHTED_MEANS[key], 0)
            else:
                total[key] = total.get(key, 0) + value
    for key, (part, whole) in _RATIOS.items():
        if key in total:
            total[key] = total[part] / total[whole] if total.get(whole) else 0.0
    for key, weight in _WEIGHTED_MEANS.items():
        if key in total:
            total[key] = total[key] / total[weight] if total.get(weight) else 0.0
    return total


@dataclass
class ReplicaView:
    """What the ingress knows of one replica, as of its latest health probe."""

    healthy: bool
    in_flight: int  # requests this ingress has routed there and not yet seen finish
    routed: int  # requests routed there since start (retries included)
    stats: Mapping[str, Any]


class ReplicaCollector(Collector):
    def __init__(self, views: Callable[[], Mapping[str, ReplicaView]]) -> None:
        self.views = views

    def collect(self) -> Iterator[Metric]:
        views = self.views()
        label = ["replica"]
        healthy = GaugeMetricFamily("kvserve_replica_healthy", "1 while the replica answers probes", labels=label)
        in_flight = GaugeMetricFamily(
            "kvserve_replica_routed_in_flight", "Requests routed to the replica, not yet finished", labels=label
        )
        routed = CounterMetricFamily("kvserve_replica_routed", "Requests routed to the replica", labels=label)
        for name, view in views.items():
            healthy.add_metric([name], int(view.healthy))
            in_flight.add_metric([name], view.in_flight)
            routed.add_metric([name], view.routed)
        yield from (healthy, in_flight, routed)
        for key, (metric, kind, doc) in ENGINE_METRICS.items():
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(metric.replace("kvserve_", "kvserve_replica_", 1), f"{doc}, per replica", labels=label)
            for name, view in views.items():
                if _number(view.stats.get(key)):
                    family.add_metric([name], view.stats[key])
            if family.samples:
                yield family
