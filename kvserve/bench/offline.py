"""Replay a workload through the in-process engine (no HTTP, no tokenizer round trip at the client).

Each request is added when its arrival time comes and the engine is stepped until everything has
finished. Emission times come from the engine's own ``token_times``, on the same perf_counter clock,
so the difference from an HTTP replay of the same workload is the server's (and client's) overhead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvserve.bench.records import RequestRecord
from kvserve.bench.workload import WorkloadRequest, input_len_of, token_ids_for


@dataclass(frozen=True)
class OfflineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    max_num_seqs: int | None = None  # None: the engine's default
    enable_prefix_caching: bool | None = None  # None: the engine's default
    warmup: int = 0
    temperature: float = 0.0
    ignore_eos: bool | None = None  # True/False forces it on every request; None: per request
    seed: int = 0  # for the token ids of ``input_len`` requests
    quiet: bool = False
    # Text prompts go through the model's chat template as one user message, as the server's
    # /v1/chat/completions would send them; token-id prompts are always taken as they are.
    chat: bool = False


def make_engine(cfg: OfflineConfig) -> Any:
    """An LLMEngine for ``cfg``; unset limits keep the engine's defaults."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine

    options: dict[str, Any] = {"model": cfg.model, "dtype": cfg.dtype}
    if cfg.max_num_seqs is not None:
        options["max_num_seqs"] = cfg.max_num_seqs
    if cfg.enable_prefix_caching is not None:
        options["enable_prefix_caching"] = cfg.enable_prefix_caching
    return LLMEngine(EngineConfig(**options))


def _params(req: WorkloadRequest, cfg: OfflineConfig) -> Any:
    from kvserve.engine.sampling_params import SamplingParams

    ignore_eos = req.ignore_eos if cfg.ignore_eos is None else cfg.ignore_eos
    return SamplingParams(max_tokens=req.max_tokens, temperature=cfg.temperature, ignore_eos=ignore_eos)


def _prompt(engine: Any, req: WorkloadRequest, cfg: OfflineConfig) -> str | list[int]:
    if req.prompt is None:
        ids = token_ids_for(req, cfg.seed)
        if ids is None:
            raise ValueError(f"workload request {req.id!r} has none of prompt, input_ids, input_len")
        return ids
    if cfg.chat:
        return engine.tokenizer.encode_chat([{"role": "user", "content": req.prompt}])
    return req.prompt


def _record(req: WorkloadRequest, output: Any, t0: float) -> RequestRecord:
    completion = output.outputs[0]
    failures = {"abort": "aborted by the engine", "error": "engine error"}
    error = output.error or failures.get(completion.finish_reason)
    return RequestRecord(
        id=req.id,
        arrival=output.metrics.arrival_time - t0,
        token_times=[t - t0 for t in completion.token_times],
        max_tokens=req.max_tokens,
        input_len=len(output.prompt_token_ids),
        sent=output.metrics.arrival_time - t0,
        text=completion.text,
        finish_reason=completion.finish_reason,
        error=error,
        tenant=req.tenant,
        cached_tokens=output.num_cached_tokens,
        accept=req.accept,
        count_source="engine",
    )


# Engine counters that only grow, so after - before is the measured run's share (warmup excluded).
RUN_COUNTERS = (
    "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "generated_tokens",
    "preemptions", "row_block_deferrals", "steps",
)  # fmt: skip


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in RUN_COUNTERS if k in before and k in after}


def _run_warmup(engine: Any, cfg: OfflineConfig) -> None:
    for i in range(cfg.warmup):
        req = WorkloadRequest(id=f"warmup{i}", arrival_ms=0, prompt=f"Warmup {i}: say hello.", max_tokens=8)
        engine.add_request(req.id, req.prompt, _params(req, cfg))
    while engine.has_unfinished_requests():
        engine.step()


def replay_offline(
    requests: list[WorkloadRequest], cfg: OfflineConfig, engine: Any | None = None
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Replay ``requests`` (sorted by arrival) through ``engine`` (default: ``make_engine(cfg)``).
    Returns records in workload order and the run's meta description."""
    from kvserve.engine.input_processor import QueueFullError

    engine = engine or make_engine(cfg)
    _run_warmup(engine, cfg)
    stats_before = engine.stats()
    by_id = {r.id: r for r in requests}
    records: dict[str, RequestRecord] = {}
    pending = deque(sorted(requests, key=lambda r: r.arrival_ms))
    bar = tqdm(total=len(requests), disable=cfg.quiet, unit="req", desc="offline")
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_ms / 1000 <= now:
            req = pending.popleft()
            prompt = _prompt(engine, req, cfg)
            try:
                arrival_time = t0 + req.arrival_ms / 1000
                engine.add_request(req.id, prompt, _params(req, cfg), arrival_time, req.cache_salt)
            except (ValueError, QueueFullError) as exc:  # the request's failure, not the run's
                records[req.id] = RequestRecord(
                    id=req.id,
                    arrival=req.arrival_ms / 1000,
                    max_tokens=req.max_tokens,
                    input_len=input_len_of(req),
                    error=f"{type(exc).__name__}: {exc}",
                    tenant=req.tenant,
                    accept=req.accept,
                )
                bar.update(1)
        if not engine.has_unfinished_requests():
            if pending:  # idle until the next arrival; the engine has nothing to do
                time.sleep(max(0.0, t0 + pending[0].arrival_ms / 1000 - time.perf_counter()))
            continue
        for output in engine.step():
            if output.finished:
                records[output.request_id] = _record(by_id[output.request_id], output, t0)
                bar.update(1)
    bar.close()
    stats_after = engine.stats()
    meta = {
        "source": "offline engine (in-process, no HTTP)",
        "model": cfg.model,
        "dtype": cfg.dtype,
        "max_num_seqs": cfg.max_num_seqs or "engine default",
        "enable_prefix_caching": ("engine default" if cfg.enable_prefix_caching is None else cfg.enable_prefix_caching),
        "warmup": f"{cfg.warmup} requests before time 0, excluded from every number",
        "temperature": cfg.temperature,
        "prompts": "chat template (one user message)" if cfg.chat else "as given",
        "token_counting": "engine token_times (one per token)",
        "engine_counters": counter_deltas(stats_before, stats_after),
        # Raw snapshots; gauges such as hit rates or batch sizes cover the engine's whole life.
        "engine_stats": {"before": stats_before, "after": stats_after},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return [records[r.id] for r in requests], meta
