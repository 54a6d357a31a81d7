"""A model-free stand-in for LLMEngine.step that drives the real Scheduler and BlockPool.

The fake runner writes into each KV slot what the real K/V there would depend on: the cache key and
every token up to and including that position (causal attention). A sequence that reads a slot whose
content differs from what it expects would attend to wrong K/V, so every read is checked; with a
`window` (every layer windowed) a query at p reads only positions p - window + 1 .. p, and the scheduler
releases the blocks behind. Each step also checks the pool's bookkeeping against the block tables (see
`check_invariants`).
"""

from __future__ import annotations

import itertools

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.outputs import RequestMetrics
from kvserve.engine.prefix_cache import CacheKey, extend_block_hashes
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kvserve.engine.sequence import RELEASED_SLOT, Request, SeqStatus, Sequence
from kvserve.intmath import div_ceil

# What a KV slot holds: (cache key digest, token ids of positions 0..p) for the position p written there.
SlotContent = tuple[bytes, tuple[int, ...]]
# Sample i of a request always appends OUTPUT_TOKEN + i: forks diverge, yet nothing depends on a model.
OUTPUT_TOKEN = 1000
FINGERPRINT = "fake-model"


class FakeEngine:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        enable_caching: bool = True,
        enable_chunked_prefill: bool = True,
        row_block: int | None = None,
        window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.scheduler = Scheduler(
            self.pool, block_size, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill, row_block, window
        )
        self.slots: list[list[SlotContent | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.requests: dict[str, Request] = {}
        # Prompt tokens each request found cached when first admitted, and the totals the pool must report.
        self.cached_at_admission: dict[str, int] = {}
        self.expected_queries = 0
        self.expected_hits = 0
        self._clock = itertools.count()

    # ---- requests ----
    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int = 1,
        n: int = 1,
        cache_salt: str | None = None,
        fingerprint: str = FINGERPRINT,
    ) -> Request:
        order = next(self._clock)
        request = Request(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=list(prompt),
            params=SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0),
            metrics=RequestMetrics(arrival_time=float(order)),
            cache_salt=cache_salt,
            cache_key_digest=CacheKey(fingerprint, None, cache_salt).digest(),
            order=order,
            base_seed=0,
            tokenizer=None,  # type: ignore[arg-type]  # never decoded: tokens are appended directly
        )
        self.requests[request_id] = request
        self.scheduler.add(request.new_sequence(0))
        return request

    def abort(self, request_id: str) -> None:
        """As LLMEngine.abort_request: every unfinished sample leaves the scheduler and frees its blocks."""
        request = self.requests.pop(request_id)
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)

    @property
    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.sequences if not s.is_finished]

    # ---- one iteration ----
    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self._check_limits(out)
        self._record_admissions(out)
        self._check_blocks_held(out)
        self._copy_blocks(out.block_copies)
        for item in out.scheduled:
            self._write(item)
        for item in out.scheduled:  # after all writes: attention reads every position up to the last new one
            seq = item.seq
            for position in range(self.first_visible(seq), seq.num_computed_tokens + item.num_new_tokens):
                assert self._slot(seq, position) == self.expected(seq, position), (
                    f"{seq.request.request_id}[{seq.index}] reads wrong K/V at position {position}"
                )
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        self.scheduler.register_computed_blocks(item.seq for item in out.scheduled)
        for item in out.scheduled:
            if item.num_logits:
                self._sample(item.seq)
        return out

    def run_until_done(self, max_steps: int = 1000) -> int:
        """Step until every request has finished; returns the number of steps taken."""
        for steps in range(max_steps):
            if not self.scheduler.num_unfinished:
                return steps
            self.step()
            self.check_invariants()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def first_visible(self, seq: Sequence) -> int:
        """The first position the sequence's next query (at num_computed_tokens) reads."""
        return 0 if self.window is None else max(seq.num_computed_tokens - self.window + 1, 0)

    def expected(self, seq: Sequence, position: int) -> SlotContent:
        return seq.request.cache_key_digest, tuple(seq.token_ids[: position + 1])

    def _check_limits(self, out: SchedulerOutput) -> None:
        scheduler = self.scheduler
        # Without chunked prefill a prompt larger than the budget may run, but only alone.
        assert out.num_tokens <= scheduler.max_num_batched_tokens or (
            not scheduler.enable_chunked_prefill and len(out.scheduled) == 1
        ), f"{out.num_tokens} tokens scheduled, budget {scheduler.max_num_batched_tokens}"
        assert len(scheduler.running) <= scheduler.max_num_seqs

    def _record_admissions(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq, request = item.seq, item.seq.request
            if request.request_id in self.cached_at_admission:
                continue
            # A hit covers whole blocks and never the last prompt token, whose logits are needed.
            hit = seq.num_computed_tokens
            assert hit % self.block_size == 0 and hit < seq.num_prompt_tokens
            self.cached_at_admission[request.request_id] = hit
            if self.pool.enable_caching:
                self.expected_queries += seq.num_prompt_tokens
                self.expected_hits += hit

    def _check_blocks_held(self, out: SchedulerOutput) -> None:
        """With a window, a scheduled sequence holds only the blocks of its window and of its new tokens."""
        if self.window is None:
            return
        for item in out.scheduled:
            most = div_ceil(self.window + item.num_new_tokens - 2, self.block_size) + 1
            assert len(item.seq.held_blocks) <= most, f"{len(item.seq.held_blocks)} blocks held, at most {most}"

    def _slot(self, seq: Sequence, position: int) -> SlotContent | None:
        return self.slots[seq.block_table[position // self.block_size]][position % self.block_size]

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        # As KVCache.copy_blocks: every source is read before any destination is written.
        sources = [list(self.slots[src]) for src, _ in copies]
        for (_, dst), content in zip(copies, sources, strict=True):
            self.slots[dst] = content

    def _write(self, item: ScheduledSeq) -> None:
        seq = item.seq
        start = seq.num_computed_tokens
        for position in range(start, start + item.num_new_tokens):
            block = seq.block_table[position // self.block_size]
            # Only a private block outside the cache index may change (block_pool.py's invariant).
            assert self.pool.ref_count(block) == 1, f"write into block {block} shared by others"
            assert self.pool.identity(block) is None, f"write into cached block {block}"
            self.slots[block][position % self.block_size] = self.expected(seq, position)

    def _sample(self, seq: Sequence) -> None:
        request = seq.request
        samples = [seq]
        if seq.index == 0 and seq.num_output_tokens == 0 and len(request.sequences) < request.params.n:
            samples += self.scheduler.fork(seq)
        for sample in samples:
            sample.token_ids.append(OUTPUT_TOKEN + sample.index)
            if sample.num_output_tokens >= request.params.max_tokens:
                self.scheduler.remove(sample)
        if request.finished:
            del self.requests[request.request_id]

    # ---- checks ----
    def check_invariants(self) -> None:
        pool = self.pool
        owners = [0] * pool.num_blocks
        for seq in self.live_sequences:
            held = seq.held_blocks
            assert len(set(held)) == len(held), "a block twice in one block table"
            released = seq.num_released_blocks
            assert seq.block_table[:released] == [RELEASED_SLOT] * released
            # A released block never held a key the sequence's next query (or any later one) sees.
            assert released * self.block_size <= self.first_visible(seq), "a block released inside the window"
            if seq.status is SeqStatus.WAITING:
                assert not seq.block_table and not released, "a waiting sequence holds blocks"
            for block in held:
                owners[block] += 1
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == owners[block], f"block {block}: ref count != block tables holding it"
            assert pool.is_free(block) == (owners[block] == 0), f"block {block}: free list disagrees"
        assert pool.num_free == owners.count(0)
        cached = [b for b in range(pool.num_blocks) if pool.identity(b) is not None]
        assert pool.num_cached == len(cached)
        for block in cached:
            self.check_cached_block(block)
        for request in self.requests.values():
            assert request.num_cached_tokens == self.cached_at_admission.get(request.request_id, 0)
        assert (pool.stats.queries, pool.stats.hits) == (self.expected_queries, self.expected_hits)
        scheduler = self.scheduler
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert scheduler.num_unfinished == len(self.live_sequences)

    def check_cached_block(self, block: int) -> None:
        """The block's index entry finds it, and its identity is what was really written into it."""
        identity = self.pool.identity(block)
        assert identity is not None and self.pool.lookup(identity) == block
        contents = self.slots[block]
        assert all(c is not None for c in contents), f"cached block {block} was never fully written"
        digest, tokens = contents[-1]  # type: ignore[misc]
        bs = self.block_size
        assert len(tokens) % bs == 0
        for offset, content in enumerate(contents):
            assert content == (digest, tokens[: len(tokens) - bs + offset + 1])
        assert identity.token_ids == tokens[-bs:]
        hashes: list[bytes] = []
        extend_block_hashes(hashes, list(tokens), len(tokens) // bs, bs, digest)
        assert identity.hash == hashes[-1], f"cached block {block}: hash does not match its contents"
