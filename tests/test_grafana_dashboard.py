"""docs/grafana-dashboard.json asks Prometheus only for series that /metrics exposes (names as the
prometheus client writes them: counters with _total, histograms with _bucket), and every panel has a query."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.metrics import ENGINE_METRICS, ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"


class EveryStat:
    """An engine client reporting every stat the metrics know (the router's included)."""

    error = None
    draining = False

    def stats(self) -> dict[str, float]:
        return dict.fromkeys(ENGINE_METRICS, 1.0)


def exposed_series() -> set[str]:
    metrics = ServerMetrics(EveryStat())
    metrics.requests.labels("/v1/completions", "success").inc()
    metrics.finish_reasons.labels("stop").inc()
    for histogram in (metrics.ttft, metrics.tpot, metrics.itl, metrics.e2e, metrics.queue_time):
        histogram.observe(0.1)
    text = metrics.render().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_dashboard_queries_only_exposed_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = exposed_series()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    used = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bkvserve_\w+", target["expr"]))
            assert names, target["expr"]
            assert names <= series, f"{panel['title']}: {sorted(names - series)} not in /metrics"
            used |= names
    essentials = {"kvserve_time_to_first_token_seconds_bucket", "kvserve_kv_blocks_used", "kvserve_http_requests_total"}
    assert essentials <= used
