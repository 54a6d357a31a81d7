"""Serving metrics derived from request records (book §31.2 and §31.7; Chapter 30's definitions).

Per request:
- TTFT = first emission - arrival;
- TPOT = (last emission - first emission) / (outputs - 1): the mean post-first-token gap. With one
  output it is *missing* (None), never zero, and left out of every average and percentile;
- ITL = each gap between consecutive emissions (tokens delivered together are one emission);
- E2EL = last emission - arrival (the complete-request duration).

Throughput always names its window. The drain window runs from the first arrival to the last
completion and measures how fast this finite workload drains; a fixed window [start, end] counts
only tokens emitted inside it, idle time included. Cost is charged exactly over the window.

Hard gates (TTFT, TPOT bounds) are reported as violations, by request; they are never traded for
throughput. Goodput counts requests that are acceptable (evaluation contract) AND meet every gate,
per second of the window; it sits beside raw throughput, never folded into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.bench.accept import is_acceptable
from kvserve.bench.records import RequestRecord

# Comparisons against window ends and gates allow a nanosecond, so a schedule given in whole
# milliseconds does not flip at its own boundaries through float rounding (0.15 - 0.02 != 0.13).
_EPS = 1e-9


def _ns(seconds: float) -> float:
    """Round a derived duration to the nanosecond, the clock's resolution; this removes float noise
    such as 0.15 - 0.02 = 0.12999999999999998 without changing any measurement."""
    return round(seconds, 9)


STATS = ("mean", "median", "std", "p90", "p99", "min", "max")


@dataclass(frozen=True)
class RequestMetrics:
    id: str
    ttft: float | None
    tpot: float | None
    itls: list[float]
    e2el: float | None


def emission_gaps(token_times: list[float]) -> list[float]:
    """Gaps between consecutive emissions; tokens sharing a timestamp arrived as one emission."""
    events = [t for i, t in enumerate(token_times) if i == 0 or t != token_times[i - 1]]
    return [b - a for a, b in zip(events, events[1:], strict=False)]


def request_metrics(record: RequestRecord) -> RequestMetrics:
    times = record.token_times
    if not record.ok:
        return RequestMetrics(record.id, None, None, [], None)
    tpot = _ns((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None
    return RequestMetrics(
        id=record.id,
        ttft=_ns(times[0] - record.arrival),
        tpot=tpot,
        itls=[_ns(g) for g in emission_gaps(times)],
        e2el=_ns(times[-1] - record.arrival),
    )


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean/median/std/p90/p99/min/max (linear-interpolated percentiles, population std, as
    numpy and `vllm bench serve` compute them); all None for an empty list."""
    if not values:
        return dict.fromkeys(STATS)
    a = np.asarray(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
    }


@dataclass(frozen=True)
class Window:
    """An observation window in seconds on the run's clock; ``kind`` is "drain" or "fixed"."""

    start: float
    end: float
    kind: str

    @property
    def length(self) -> float:
        return self.end - self.start

    def contains(self, t: float) -> bool:
        return self.start - _EPS <= t <= self.end + _EPS


def drain_window(records: list[RequestRecord]) -> Window:
    """First arrival to last completion (of the completed requests)."""
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.token_times[-1] for r in records if r.ok), default=start)
    return Window(start, end, "drain")


def fixed_window(records: list[RequestRecord], length_s: float, start_s: float | None = None) -> Window:
    """A fixed window of ``length_s`` seconds, starting at ``start_s`` (default: first arrival)."""
    if not length_s > 0:
        raise ValueError(f"window length must be > 0, got {length_s}")
    start = min((r.arrival for r in records), default=0.0) if start_s is None else start_s
    return Window(start, start + length_s, "fixed")


def _per_second(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def window_summary(records: list[RequestRecord], window: Window) -> dict[str, Any]:
    """Output tokens emitted inside the window and requests completed inside it, per second."""
    tokens = sum(1 for r in records if r.ok for t in r.token_times if window.contains(t))
    completed = sum(1 for r in records if r.ok and window.contains(r.token_times[-1]))
    return {
        "kind": window.kind,
        "start_ms": window.start * 1000,
        "end_ms": window.end * 1000,
        "duration": window.length,
        "output_tokens": tokens,
        "completed": completed,
        "output_throughput": _per_second(tokens, window.length),
        "request_throughput": _per_second(completed, window.length),
    }


@dataclass(frozen=True)
class Gates:
    """Hard bounds a request must meet, in ms; None = no gate."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def gate_violations(metrics: list[RequestMetrics], gates: Gates) -> list[dict[str, Any]]:
    """Every (request, gate) pair exceeding its bound. A missing TPOT cannot violate a TPOT gate
    (there is no post-first-token pace to judge); failed requests are reported as failures."""
    violations = []
    for m in metrics:
        for name, value, limit_ms in (("ttft", m.ttft, gates.ttft_ms), ("tpot", m.tpot, gates.tpot_ms)):
            if limit_ms is not None and value is not None and value > limit_ms / 1000 + _EPS:
                violations.append(
                    {"id": m.id, "metric": name, "value_ms": round(value * 1000, 6), "limit_ms": limit_ms}
                )
    return violations


def goodput_summary(records: list[RequestRecord], violations: list[dict[str, Any]], window: Window) -> dict[str, Any]:
    """Requests completed inside the window that pass their accept criterion (one without a
    criterion passes when it completes) and meet every gate."""
    violating = {v["id"] for v in violations}
    done = [r for r in records if r.ok and window.contains(r.token_times[-1])]
    accepted = [r for r in done if r.accept is None or is_acceptable(r.text, r.accept)]
    good = [r for r in accepted if r.id not in violating]
    return {
        "completed_in_window": len(done),
        "with_criterion": sum(1 for r in done if r.accept is not None),
        "accepted": len(accepted),
        "rejected_ids": [r.id for r in done if not any(a is r for a in accepted)],
        "within_gates": sum(1 for r in done if r.id not in violating),
        "good": len(good),
        "good_ids": [r.id for r in good],
        "request_goodput": _per_second(len(good), window.length),
    }


def cost_summary(price_per_hour: float, window: Window, output_tokens: int, good: int) -> dict[str, float | None]:
    """Resource cost charged exactly over the window (no minimum billing), per 1,000 output
    tokens emitted in it, and per acceptable answer (accepted and within every gate)."""
    dollars = price_per_hour * window.length / 3600
    return {
        "price_per_hour": price_per_hour,
        "window_duration": window.length,
        "dollars": dollars,
        "per_1k_output_tokens": dollars / output_tokens * 1000 if output_tokens else None,
        "per_acceptable_answer": dollars / good if good else None,
    }


def summarize(
    records: list[RequestRecord],
    window: Window | None = None,
    gates: Gates = Gates(),
    price_per_hour: float | None = None,
) -> dict[str, Any]:
    """The results summary: `vllm bench serve` field names over the drain window, then ours
    (``window``, ``gates``, ``goodput``, ``cost``) over ``window`` (default: the drain window),
    then per-request arrays (seconds, None where missing)."""
    metrics = [request_metrics(r) for r in records]
    done = [r for r in records if r.ok]
    drain = drain_window(records)
    window = window or drain
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.input_len or 0 for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": drain.length,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": _per_second(len(done), drain.length),
        "output_throughput": _per_second(out_tokens, drain.length),
        "total_token_throughput": _per_second(in_tokens + out_tokens, drain.length),
    }
    series = {
        "ttft": [m.ttft for m in metrics if m.ttft is not None],
        "tpot": [m.tpot for m in metrics if m.tpot is not None],
        "itl": [g for m in metrics for g in m.itls],
        "e2el": [m.e2el for m in metrics if m.e2el is not None],
    }
    for name, values in series.items():
        for stat, value in distribution(values).items():
            summary[f"{stat}_{name}_ms"] = None if value is None else round(value * 1000, 6)
    summary["tpot_missing"] = [m.id for m in metrics if m.ttft is not None and m.tpot is None]

    win = window_summary(records, window)
    violations = gate_violations(metrics, gates)
    goodput = goodput_summary(records, violations, window)
    summary["window"] = win
    summary["gates"] = {"ttft_ms": gates.ttft_ms, "tpot_ms": gates.tpot_ms, "violations": violations}
    summary["goodput"] = goodput
    summary["request_goodput"] = goodput["request_goodput"]
    summary["cost"] = (
        None if price_per_hour is None else cost_summary(price_per_hour, window, win["output_tokens"], goodput["good"])
    )
    summary.update(
        ids=[r.id for r in records],
        input_lens=[r.input_len for r in records],
        output_lens=[r.output_len for r in records],
        ttfts=[m.ttft for m in metrics],
        tpots=[m.tpot for m in metrics],
        itls=[m.itls for m in metrics],
        e2els=[m.e2el for m in metrics],
        errors=[r.error or "" for r in records],
        generated_texts=[r.text for r in records],
    )
    return summary
