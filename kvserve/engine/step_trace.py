"""What each engine iteration did, kept for the live view (`GET /v1/engine/events`): a bounded ring.

The engine thread appends one StepRecord per forward pass that ran (a step whose forward pass raised is
not recorded); readers on other threads copy the records newer than the last step they saw.

Invariants:
- records hold plain ints, floats, strings and tuples; nothing is formatted or encoded on the engine
  thread (the server encodes what it sends, on its own loop);
- the ring keeps the newest `capacity` records; older ones fall off, so memory is bounded whoever reads;
- `deque.append` and `deque.copy` are each a single C call under the GIL, so a reader never sees a
  half-appended ring and the engine never waits for a reader (no lock).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Request

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

DEFAULT_CAPACITY = 4096


class SeqWork(NamedTuple):
    """One scheduled sequence's share of a step."""

    request_id: str
    sample: int  # index of the sample within its request (n > 1)
    prefill_tokens: int  # prompt tokens fed (a chunk, or the whole rest); also a recompute after preemption
    decode_tokens: int  # 1 + the draft tokens verified with it; 0 for a prefill
    accepted_drafts: int  # drafts the verification kept (0 without speculation)


class FinishedRequest(NamedTuple):
    request_id: str
    ttft_s: float | None  # arrival to first token
    tpot_s: float | None  # (last - first token) / (tokens - 1) of sample 0; None for one token


class StepRecord(NamedTuple):
    step: int  # the engine's step counter after this step (1 for the first)
    wall_time: float  # time.time() when the step began
    duration_s: float  # scheduling, forward pass, sampling and output processing
    seqs: tuple[SeqWork, ...]  # in batch order; len() is the batch size
    num_tokens: int  # tokens fed to the model: sum of prefill and decode tokens
    kv_blocks_used: int  # held by sequences
    kv_blocks_cached: int  # holding a prefix-cache identity, in use or free
    kv_blocks_free: int  # free, cached-but-unused included
    num_waiting: int  # sequences waiting for admission after this step
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens served from cached blocks
    spec_proposed: int  # cumulative draft tokens proposed
    spec_accepted: int  # cumulative draft tokens accepted
    finished: tuple[FinishedRequest, ...]  # requests that finished in this step (not aborted or failed)


def work_of(sched: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(request id, sample, prefill tokens, decode tokens) of each scheduled sequence; call after the
    forward pass and before the step advances the sequences (their prefill state is read here)."""
    work = []
    for item in sched.scheduled:
        seq = item.seq
        prefill = not seq.spec_tokens and (seq.in_prefill or seq.num_output_tokens == 0)
        tokens = item.num_new_tokens
        work.append((seq.request.request_id, seq.index, tokens if prefill else 0, 0 if prefill else tokens))
    return work


def finished_of(requests: Iterable[Request]) -> tuple[FinishedRequest, ...]:
    finished = []
    for request in requests:
        if not request.finished or request.error is not None or not request.sequences:
            continue
        m = request.metrics
        ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
        times = request.sequences[0].token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        finished.append(FinishedRequest(request.request_id, ttft, tpot))
    return tuple(finished)


class StepTrace:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"step trace capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._records: deque[StepRecord] = deque(maxlen=capacity)

    def record(
        self,
        engine: LLMEngine,
        work: list[tuple[str, int, int, int]],
        accepted: dict[tuple[str, int], int],
        began_wall: float,
        began: float,
        touched: Iterable[Request],
    ) -> None:
        """Append the step the engine just ran. `accepted`: (request id, sample) -> drafts kept."""
        pool = engine.pool
        spec = engine.speculator.stats if engine.speculator is not None else None
        seqs = tuple(SeqWork(rid, i, p, d, accepted.get((rid, i), 0)) for rid, i, p, d in work)
        self._records.append(
            StepRecord(
                step=engine.counters.steps,
                wall_time=began_wall,
                duration_s=time.perf_counter() - began,
                seqs=seqs,
                num_tokens=sum(s.prefill_tokens + s.decode_tokens for s in seqs),
                kv_blocks_used=pool.num_used,
                kv_blocks_cached=pool.num_cached,
                kv_blocks_free=pool.num_free,
                num_waiting=len(engine.scheduler.waiting),
                prefix_cache_queries=pool.stats.queries,
                prefix_cache_hits=pool.stats.hits,
                spec_proposed=spec.proposed if spec is not None else 0,
                spec_accepted=spec.accepted if spec is not None else 0,
                finished=finished_of(touched),
            )
        )

    def append(self, record: StepRecord) -> None:
        self._records.append(record)

    @property
    def last_index(self) -> int:
        """The newest recorded step's index, 0 before any."""
        records = self._records
        return records[-1].step if records else 0

    def since(self, index: int) -> list[StepRecord]:
        """The records of steps after `index`, oldest first (those still in the ring)."""
        records = self._records.copy()
        newer: list[StepRecord] = []
        while records and records[-1].step > index:
            newer.append(records.pop())
        newer.reverse()
        return newer
