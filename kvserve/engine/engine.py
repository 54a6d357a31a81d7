"""LLMEngine: add requests, run one iteration per `step()`, abort; the core every front end drives.

One step, in phases (`step`): plan drafts (spec/) -> schedule (scheduler.py) -> one forward pass
(runner.py) -> account what it computed -> sample (sampler.py) or verify drafts (spec/) -> emit: append
tokens, detokenize, check stops, free the blocks of finished sequences at once. A phase that fails fails
the requests it served, never the engine. A request's input is admitted by input_processor.py; the device,
dtype and weight format come from platform.py.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.config import EngineConfig
from kvserve.engine.block_pool import BlockPool
from kvserve.engine.host_memory import keep_freed_memory, return_freed_memory
from kvserve.engine.input_processor import InputProcessor, Prompt, QueueFullError
from kvserve.engine.logits_processors import process_logits
from kvserve.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from kvserve.engine.platform import keeps_quantized, resolve_device, resolve_dtype
from kvserve.engine.prefix_cache import CacheKey
from kvserve.engine.runner import KVCache, ModelRunner, spans_of
from kvserve.engine.sampler import sample_rows, token_logprobs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kvserve.engine.sequence import Request, Sequence
from kvserve.engine.step_trace import StepTrace, work_of
from kvserve.engine.stop_checker import append_token
from kvserve.intmath import div_ceil
from kvserve.kernels.backends import default_attention_backend, get_attention_backend
from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaModel
from kvserve.model.registry import load_model
from kvserve.spec.draft import DraftModelProposer
from kvserve.spec.setup import build_draft_proposer
from kvserve.spec.speculator import Speculator
from kvserve.structured.masks import start_masks

logger = logging.getLogger(__name__)


# One sequence's tokens of this step (one sampled, or a verification's accepted drafts and its correction)
# with their logprobs where asked for.
Emission = tuple[Sequence, list[int], list | None]


class ForwardResult(NamedTuple):
    logits: torch.Tensor  # [rows, vocab]: the scheduled items' logits rows, in schedule order
    grammar_masks: Future[dict[int, torch.Tensor]] | None  # computing while the pass ran


@dataclass
class EngineCounters:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prefill work actually done (prefix-cache hits excluded)
    generated_tokens: int = 0
    last_batch_size: int = 0
    max_batch_size: int = 0
    last_batch_tokens: int = 0
    batch_size_sum: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    structured_truncated: int = 0  # constrained samples ended by max_tokens or the context ("length")


def _release_window(target: ModelConfig, draft: DraftModelProposer | None) -> int | None:
    """The window behind which the scheduler may release a sequence's blocks: set only when every layer of
    every model reading the cache has one, the target's and a separate draft model's (a self-draft runs the
    target's own layers); the widest of them."""
    readers = [target] + ([draft.runner.model.config] if draft is not None and draft.mirrors_target else [])
    windows = [c.window_of_every_layer for c in readers]
    known = [w for w in windows if w is not None]
    return max(known) if len(known) == len(windows) else None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations then reuse their pages: host_memory.py
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        weights = loaded.load_weights(self.dtype, keeps_quantized(config.quantization, self.device))
        self.model = LlamaModel(mcfg, weights, self.dtype, self.device, self.max_model_len)
        # Which matrices run from GGUF blocks ("none": all dequantized); the same file quantized or not
        # computes different values, so the prefix cache must not share blocks between the two.
        self.quantization = weights.quantization()
        logger.info("%s: %s weights, quantized matrices: %s", loaded.name, self.dtype, self.quantization)
        # Everything that decides a block's K/V: the weights, the dtype, the quantization and the whole
        # architecture (RoPE, windows, norms; the config is a frozen dataclass of plain values, so its repr is stable).
        identity = (loaded.weights_id, str(self.dtype), self.quantization, mcfg)
        self.fingerprint = hashlib.sha256(repr(identity).encode()).hexdigest()[:32]
        block_size = config.block_size
        num_blocks = config.num_kv_blocks or max(
            2, config.kv_cache_memory_bytes // KVCache.bytes_per_block(self.model, block_size)
        )
        self.cache = KVCache(self.model, num_blocks, block_size)
        if self.device.type == "cpu":
            return_freed_memory()  # the load's copies of the weights: host_memory.py
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.attention_backend = (
            default_attention_backend(self.device) if config.attention_backend == "auto" else config.attention_backend
        )
        attention = get_attention_backend(self.attention_backend, self.device, windowed=mcfg.has_windows)
        self.runner = ModelRunner(self.model, self.cache, attention)
        draft = build_draft_proposer(config.speculative, self.runner, self.dtype, self.device, num_blocks)
        self.speculator = Speculator(config.speculative, draft) if config.speculative else None
        window = _release_window(mcfg, draft)
        self.inputs = InputProcessor(self.tokenizer, mcfg.vocab_size, self.max_model_len, num_blocks, config, window)
        # The most tokens (prompt + output) one sequence can hold: the context, and the blocks it holds at once.
        fits = self.inputs.most_blocks_held(self.max_model_len) <= num_blocks
        self.max_sequence_len = self.max_model_len if fits else num_blocks * block_size
        # Decode-only steps have at most max_num_seqs rows (drafts turn row blocks off).
        self.scheduler = Scheduler(
            self.pool,
            block_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_chunked_prefill,
            self.model.row_block(config.max_num_seqs),
            window,
        )
        self.requests: dict[str, Request] = {}
        self._seed_rng = random.Random(config.seed)
        self._order = 0
        self.counters = EngineCounters()
        # Set by whoever wants a record of every step (the server's live view): step_trace.py.
        self.step_trace: StepTrace | None = None

    # ---- requests ----
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (naming the field) on bad input, QueueFullError when full."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        prompt_text, prompt_ids = self.inputs.process(prompt, params)
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting_requests} requests)")
        request = Request(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time),
            cache_salt=cache_salt,
            cache_key_digest=CacheKey(self.fingerprint, None, cache_salt).digest(),
            order=self._order,
            base_seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(62),
            tokenizer=self.tokenizer,
        )
        first = request.new_sequence(0)  # raises ValueError for a grammar that does not compile
        self._order += 1
        self.requests[request_id] = request
        self.scheduler.add(first)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._close_request(request, "abort")
        self.counters.requests_aborted += 1
        return request.to_output()

    def _close_request(self, request: Request, reason: str) -> None:
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish_reason = reason
                seq.visible_text_len = len(seq.detokenizer.text)
                self.scheduler.remove(seq)
        # Unforked samples will never exist: create them as finished so outputs stay n long.
        while len(request.sequences) < request.params.n:
            seq = request.new_sequence(len(request.sequences))
            seq.finish_reason = reason
            self.scheduler.remove(seq)
        request.metrics.finished_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one iteration ----
    def step(self) -> list[RequestOutput]:
        """One iteration in phases: plan drafts, schedule, forward, account, sample, verify, emit. A phase
        that fails fails only the requests it served. Returns the output of every request the step touched."""
        began_wall, began = time.time(), time.perf_counter()
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        touched: dict[str, Request] = {}  # request id -> request, in the order the step touched them
        forward = self._forward(sched, touched)
        if forward is None:
            return self._outputs_of(touched)
        self._count_step(sched)
        trace = self.step_trace
        work = work_of(sched) if trace is not None else []
        jobs, verifications = self._account(sched, forward.logits)
        emissions = self._sample(jobs, forward, touched)
        accepted: dict[tuple[str, int], int] = {}  # (request id, sample) -> drafts kept, for the trace
        emissions += self._verify(verifications, touched, accepted)
        self._emit_all(emissions, touched)
        if verifications:
            self.scheduler.register_computed_blocks(s for s, _ in verifications if not s.is_finished)
        if trace is not None:
            trace.record(self, work, accepted, began_wall, began, touched.values())
        return self._outputs_of(touched)

    def _forward(self, sched: SchedulerOutput, touched: dict[str, Request]) -> ForwardResult | None:
        """Copy blocks, draft, start the grammar masks and run the forward pass; None when it failed, which
        fails every scheduled request (into `touched`), not the engine."""
        start = time.perf_counter()
        for item in sched.scheduled:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = start
        grammar_masks = None
        try:
            self.cache.copy_blocks(sched.block_copies)
            if self.speculator is not None:
                self.speculator.draft(sched)
            spans = spans_of(sched)
            grammar_masks = self._start_grammar_masks(sched)
            logits = self.runner.execute(spans)
            if self.speculator is not None:
                self.speculator.observe(spans, sched.num_tokens)
        except Exception as exc:
            logger.exception("forward pass failed")
            if grammar_masks is not None:
                futures.wait([grammar_masks])  # its matchers are not touched while it runs
            self._fail_all([item.seq for item in sched.scheduled], exc, touched)
            return None
        return ForwardResult(logits, grammar_masks)

    def _account(
        self, sched: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, torch.Tensor]]]:
        """Advance each sequence past what the pass computed; returns the (sequence, logits row) pairs to
        sample and the (sequence, its k+1 logits rows) pairs whose drafts to verify."""
        jobs: list[tuple[Sequence, int]] = []
        verifications: list[tuple[Sequence, torch.Tensor]] = []
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            self.counters.prompt_tokens_computed += min(
                item.num_new_tokens, max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
            )
            if seq.spec_tokens:
                seq.num_computed_tokens += 1  # the fed token; accepted drafts are added on verification
                verifications.append((seq, logits[row : row + item.num_logits]))
            else:
                if seq.wants_prompt_logits:
                    self._record_prompt_logprobs(seq, logits[row : row + item.num_logits])
                seq.num_computed_tokens += item.num_new_tokens
                if item.num_logits and seq.num_computed_tokens >= seq.num_tokens:
                    jobs.extend(self._sampling_jobs(item, row))
            row += item.num_logits
        self.scheduler.register_computed_blocks(item.seq for item in sched.scheduled)
        return jobs, verifications

    def _sample(
        self, jobs: list[tuple[Sequence, int]], forward: ForwardResult, touched: dict[str, Request]
    ) -> list[Emission]:
        """One batched sampling of the jobs' rows; when it fails, it fails exactly the jobs' requests."""
        if not jobs:
            return []
        seqs = [s for s, _ in jobs]
        logits = forward.logits
        try:
            job_rows = [r for _, r in jobs]
            in_order = job_rows == list(range(logits.shape[0]))  # the common case: no copy needed
            selected = logits if in_order else logits.index_select(0, torch.tensor(job_rows, device=logits.device))
            masks = forward.grammar_masks.result() if forward.grammar_masks is not None else None
            processed = process_logits(selected, seqs, [self._eos_of(s) for s in seqs], masks)
            tokens = sample_rows(processed, [s.params for s in seqs], [s.generator for s in seqs])
            logprobs = self._logprobs(selected, tokens, seqs)
        except Exception as exc:
            logger.exception("sampling failed")
            self._fail_all(seqs, exc, touched)
            return []
        return [
            (seq, [token], [logprobs[i]] if logprobs else None)
            for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True))
        ]

    def _verify(
        self,
        verifications: list[tuple[Sequence, torch.Tensor]],
        touched: dict[str, Request],
        accepted: dict[tuple[str, int], int],
    ) -> list[Emission]:
        """Verify each sequence's drafts against its rows; a failure fails that sequence's request only."""
        emissions: list[Emission] = []
        for seq, rows in verifications:
            assert self.speculator is not None  # only a speculator puts draft tokens up for verification
            try:
                emitted = self.speculator.verify(seq, rows)
            except Exception as exc:
                logger.exception("verification failed for request %s", seq.request.request_id)
                self._fail_all([seq], exc, touched)
                continue
            seq.num_computed_tokens += len(emitted) - 1
            accepted[seq.request.request_id, seq.index] = len(emitted) - 1
            seq.spec_tokens = []
            logprobs = self._logprobs(rows[: len(emitted)], emitted, [seq] * len(emitted))
            emissions.append((seq, emitted, logprobs))
        if verifications:
            assert self.speculator is not None
            self.speculator.stats.steps += 1
        return emissions

    def _emit_all(self, emissions: list[Emission], touched: dict[str, Request]) -> None:
        """Append each emission's tokens up to a stop; a failure fails that request only."""
        now = time.perf_counter()
        for seq, tokens, logprobs in emissions:
            request = seq.request
            touched[request.request_id] = request
            if seq.is_finished:  # its request failed in an earlier phase of this step
                continue
            try:
                for i, token in enumerate(tokens):
                    if self._emit(seq, token, now, logprobs[i] if logprobs else None):
                        break
                if not seq.is_finished:  # also when every draft was rejected (one token emitted)
                    self._trim_blocks(seq)
            except Exception as exc:
                logger.exception("request %s failed while processing its output", request.request_id)
                self._fail(request, exc)

    def _fail_all(self, seqs: list[Sequence], exc: Exception, touched: dict[str, Request]) -> None:
        """Fail each of the sequences' requests once (a request's samples share its fate)."""
        for seq in seqs:
            request = seq.request
            touched[request.request_id] = request
            if request.error is None:
                self._fail(request, exc)

    def _count_step(self, sched: SchedulerOutput) -> None:
        counters = self.counters
        counters.steps += 1
        counters.last_batch_size = len(sched.scheduled)
        counters.max_batch_size = max(counters.max_batch_size, counters.last_batch_size)
        counters.batch_size_sum += counters.last_batch_size
        counters.last_batch_tokens = sched.num_tokens

    @staticmethod
    def _logprobs(rows: torch.Tensor, tokens: list[int], seqs: list[Sequence]) -> list | None:
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return None
        return token_logprobs(rows, tokens, [w or 0 for w in wanted])

    def _start_grammar_masks(self, sched: SchedulerOutput) -> Future[dict[int, torch.Tensor]] | None:
        """Start the grammar masks of the constrained sequences that sample this step (not verifying
        drafts), to be computed while the forward pass runs."""
        matchers = {
            item.seq.seq_id: item.seq.matcher
            for item in sched.scheduled
            if item.seq.matcher is not None
            and not item.seq.spec_tokens
            and item.num_logits
            and item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_tokens
        }
        return start_masks(matchers, self.model.config.vocab_size) if matchers else None

    def _trim_blocks(self, seq: Sequence) -> None:
        """Release blocks that only held K/V of rejected drafts (positions >= num_tokens)."""
        keep = div_ceil(seq.num_tokens, self.config.block_size)
        if len(seq.block_table) > keep:
            self.pool.free_blocks(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _record_prompt_logprobs(self, seq: Sequence, rows: torch.Tensor) -> None:
        """Rows are the logits at positions num_computed_tokens...: row j scores the token after it."""
        request = seq.request
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # nothing scores the first prompt token
        start = seq.num_computed_tokens
        # Positions already recorded (a recomputation after preemption) and the sampling row are skipped.
        first = len(request.prompt_logprobs) - 1 - start
        last = min(rows.shape[0], seq.num_prompt_tokens - 1 - start)
        if first < last:
            targets = seq.token_ids[start + first + 1 : start + last + 1]
            num_top = [seq.params.prompt_logprobs or 0] * len(targets)
            request.prompt_logprobs.extend(token_logprobs(rows[first:last], targets, num_top))

    def _sampling_jobs(self, item: ScheduledSeq, row: int) -> list[tuple[Sequence, int]]:
        seq = item.seq
        request = seq.request
        last_row = row + item.num_logits - 1
        if len(request.sequences) < request.params.n and seq.index == 0 and seq.num_output_tokens == 0:
            return [(seq, last_row), *((child, last_row) for child in self.scheduler.fork(seq))]
        return [(seq, last_row)]

    def _emit(self, seq: Sequence, token: int, now: float, logprob: TokenLogprob | None) -> bool:
        """Append one token; True when the sequence finished (its blocks are then already free)."""
        request = seq.request
        if logprob is not None:
            seq.logprobs.append(logprob)
        seq.token_times.append(now)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        self.counters.generated_tokens += 1
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            raise RuntimeError(f"token {token} breaks the grammar: {seq.matcher.get_error()}")
        if not append_token(seq, token, self._eos_of(seq), self.max_model_len):
            return False
        if seq.matcher is not None and seq.finish_reason == "length":
            self.counters.structured_truncated += 1
        self.scheduler.remove(seq)
        if request.finished:
            request.metrics.finished_time = now
            self.counters.requests_finished += 1
        return True

    def _eos_of(self, seq: Sequence) -> list[int]:
        return [] if seq.params.ignore_eos else self.tokenizer.stop_token_ids

    def _fail(self, request: Request, exc: Exception) -> None:
        request.error = f"{type(exc).__name__}: {exc}"
        self._close_request(request, "error")
        self.counters.requests_failed += 1
        self.requests.pop(request.request_id, None)

    def _outputs_of(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """Each touched request's output; finished requests leave the engine."""
        outputs = []
        for request in touched.values():
            outputs.append(request.to_output())
            if request.finished:
                self.requests.pop(request.request_id, None)
        return outputs

    # ---- observability ----
    def stats(self) -> dict[str, float | int | str]:
        pool = self.pool
        c = self.counters
        return {
            "model": self.model_name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.attention_backend,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "prefix_cache_queries": pool.stats.queries,
            "prefix_cache_hits": pool.stats.hits,
            "prefix_cache_hit_rate": pool.stats.hit_rate,
            "prefix_cache_blocks": pool.num_cached,
            "prefix_cache_evictions": pool.stats.evictions,
            "preemptions": self.scheduler.num_preemptions,
            "row_block_deferrals": self.scheduler.num_row_block_deferrals,
            "steps": c.steps,
            "prompt_tokens_computed": c.prompt_tokens_computed,
            "generated_tokens": c.generated_tokens,
            "last_batch_size": c.last_batch_size,
            "max_batch_size": c.max_batch_size,
            "mean_batch_size": c.batch_size_sum / c.steps if c.steps else 0.0,
            "last_batch_tokens": c.last_batch_tokens,
            "requests_finished": c.requests_finished,
            "requests_aborted": c.requests_aborted,
            "requests_failed": c.requests_failed,
            "structured_truncated": c.structured_truncated,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
        }
