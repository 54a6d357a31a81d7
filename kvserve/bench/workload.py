"""Workload files: one request a JSON line, replayed identically against every server.

Fields of a line:

- ``id`` (str, unique), ``arrival_ms`` (>= 0, offset from the workload's time origin),
- exactly one of ``prompt`` (text), ``input_ids`` (token ids, sent as they are) or ``input_len``
  (a length only: seeded random token ids are generated at replay time, see ``token_ids_for``),
- ``max_tokens`` (>= 1),
- optional ``tenant`` and ``cache_salt`` (the tenant's prefix-cache access boundary),
- optional ``ignore_eos`` (bool; fixed-length benchmarks set it so every request emits max_tokens),
- optional ``accept``: the evaluation contract for the answer (see ``accept.py``).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.accept import validate_criterion

# Random ids for ``input_len`` requests avoid the low ids where tokenizers keep special tokens
# (SmolLM2: 0..16) and stay inside every vocabulary we replay against.
SAFE_TOKEN_RANGE = (1000, 32000)

_KNOWN = {
    "id",
    "arrival_ms",
    "max_tokens",
    "prompt",
    "input_ids",
    "input_len",
    "tenant",
    "cache_salt",
    "ignore_eos",
    "accept",
}


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    arrival_ms: float
    max_tokens: int
    prompt: str | None = None
    input_ids: list[int] | None = None
    input_len: int | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    accept: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("prompt", "input_ids", "input_len") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"request {self.id!r}: give exactly one of prompt, input_ids, input_len")
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"request id must be a non-empty string, got {self.id!r}")
        if not self.arrival_ms >= 0:
            raise ValueError(f"request {self.id!r}: arrival_ms must be >= 0, got {self.arrival_ms}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.id!r}: max_tokens must be an integer >= 1")
        if self.input_ids is not None and (
            not self.input_ids or not all(isinstance(t, int) and t >= 0 for t in self.input_ids)
        ):
            raise ValueError(f"request {self.id!r}: input_ids must be a non-empty list of ids >= 0")
        if self.input_len is not None and (not isinstance(self.input_len, int) or self.input_len < 1):
            raise ValueError(f"request {self.id!r}: input_len must be an integer >= 1")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"request {self.id!r}: prompt must be a string")
        if self.accept is not None:
            validate_criterion(self.accept)

    def to_json(self) -> dict[str, Any]:
        """The JSONL form: unset optional fields are left out."""
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "ignore_eos" and not v)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> WorkloadRequest:
        unknown = set(obj) - _KNOWN
        if unknown:
            raise ValueError(f"request {obj.get('id')!r}: unknown fields {sorted(unknown)}")
        for key in ("id", "arrival_ms", "max_tokens"):
            if key not in obj:
                raise ValueError(f"request {obj.get('id')!r}: missing field {key!r}")
        return cls(**obj)


def validate(requests: list[WorkloadRequest]) -> None:
    """Checks across requests: ids are unique (records are matched back by id)."""
    seen: set[str] = set()
    for r in requests:
        if r.id in seen:
            raise ValueError(f"duplicate request id {r.id!r}")
        seen.add(r.id)


def load(path: str | Path) -> list[WorkloadRequest]:
    """Read a JSONL workload, sorted by arrival (stable, so ties keep file order)."""
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(WorkloadRequest.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    validate(requests)
    return sorted(requests, key=lambda r: r.arrival_ms)


def save(requests: list[WorkloadRequest], path: str | Path) -> None:
    validate(requests)
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests))


def token_ids_for(request: WorkloadRequest, seed: int = 0) -> list[int] | None:
    """The token ids to send for an ``input_len`` request (None for other kinds).

    Seeded by (seed, request id), so a request gets the same ids whatever the replay order,
    concurrency or server, and different requests do not share a prefix by accident.
    """
    if request.input_len is None:
        return request.input_ids
    rng = random.Random(f"{seed}:{request.id}")
    return [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(request.input_len)]


def input_len_of(request: WorkloadRequest) -> int | None:
    """The input length known without a tokenizer (None for text prompts)."""
    if request.input_ids is not None:
        return len(request.input_ids)
    return request.input_len
