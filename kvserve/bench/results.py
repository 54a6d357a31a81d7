"""Results files: one JSON object = ``meta`` (how it was measured) + the summary's fields at top
level (so `vllm bench serve` result files and ours share names) + ``requests`` (the raw records,
from which everything else can be recomputed with another window, gate or price)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import Gates, Window, fixed_window, summarize
from kvserve.bench.records import RequestRecord


def build_results(
    records: list[RequestRecord],
    meta: dict[str, Any],
    window_ms: float | None = None,
    window_start_ms: float | None = None,
    gates: Gates | None = None,
    price_per_hour: float | None = None,
) -> dict[str, Any]:
    """Summarize ``records`` over the drain window and, when ``window_ms`` is given, the fixed
    window [window_start_ms (default: first arrival), + window_ms]."""
    window: Window | None = None
    if window_ms is not None:
        start = None if window_start_ms is None else window_start_ms / 1000
        window = fixed_window(records, window_ms / 1000, start)
    summary = summarize(records, window, gates or Gates(), price_per_hour)
    return {"meta": meta, **summary, "requests": [r.to_json() for r in records]}


def records_of(results: dict[str, Any]) -> list[RequestRecord]:
    if "requests" not in results:
        raise ValueError("results have no 'requests' records (not a kvserve bench results file?)")
    return [RequestRecord.from_json(r) for r in results["requests"]]


def save_results(results: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1) + "\n")


def load_results(path: str | Path) -> dict[str, Any]:
    """Raises ValueError naming the file when it is not a results JSON file."""
    try:
        results = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: expected a results JSON file (from `kvserve bench`); not JSON: {exc}") from None
    if not isinstance(results, dict) or "requests" not in results:
        raise ValueError(f"{path}: expected a results JSON file (from `kvserve bench`) with a 'requests' list")
    return results
