"""One measured (or given) request: its arrival and the emission time of every output token.

Every source of measurements (a schedule CSV, the HTTP replay, the offline engine) produces these
records, and every metric is derived from them alone, so all sources are measured the same way.

Invariants: times are seconds on one clock, relative to the run's origin (the workload's time 0);
``token_times`` holds one entry per output token and never decreases; several tokens delivered
in one chunk share its timestamp.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RequestRecord:
    id: str
    arrival: float
    token_times: list[float] = field(default_factory=list)
    max_tokens: int | None = None
    input_len: int | None = None
    # When the request actually left the client; later than ``arrival`` when a concurrency limit
    # or a busy client held it back (TTFT still counts from arrival: the user was waiting).
    sent: float | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    tenant: str | None = None
    cached_tokens: int | None = None
    accept: dict[str, Any] | None = None
    # How output tokens were counted: "usage", "logprobs", "chunks", "engine" or "schedule".
    count_source: str | None = None

    @property
    def ok(self) -> bool:
        """Completed: no error and at least one token emitted."""
        return self.error is None and bool(self.token_times)

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RequestRecord:
        return cls(**obj)


def load_schedule_csv(path: str | Path) -> list[RequestRecord]:
    """A given schedule (columns: request, arrival_ms, input_tokens, output_tokens, emissions_ms
    with space-separated emissions, all ms on one clock), as records."""
    records = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            emissions = [float(x) / 1000 for x in row["emissions_ms"].split()]
            declared = int(row["output_tokens"])
            if declared != len(emissions):
                raise ValueError(
                    f"{path}: request {row['request']} declares {declared} outputs but lists {len(emissions)} emissions"
                )
            if emissions != sorted(emissions):
                raise ValueError(f"{path}: request {row['request']} emissions are not in time order")
            records.append(
                RequestRecord(
                    id=row["request"],
                    arrival=float(row["arrival_ms"]) / 1000,
                    token_times=emissions,
                    max_tokens=declared,
                    input_len=int(row["input_tokens"]),
                    finish_reason="length",
                    count_source="schedule",
                )
            )
    return records
