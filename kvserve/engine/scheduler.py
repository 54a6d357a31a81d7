"""Iteration-level (continuous) batching: which sequences run in the next forward pass, and how much.

Each call to `schedule()` plans exactly one forward pass:
1. Running sequences in FCFS order get their next tokens: one token when decoding (plus any draft
   tokens to verify), a chunk of their prompt when still prefilling. Prefill chunks never take the
   budget that the remaining decoders need, so a long prompt cannot stall generation (chunked prefill).
2. If a running sequence needs a KV block and none is free, the most recently arrived running
   sequence is preempted: its blocks are freed and it rejoins the waiting queue to be recomputed.
   The oldest work always proceeds, so every request finishes (no starvation).
3. Waiting requests are admitted in arrival order while the token budget, `max_num_seqs` (counting the
   n samples a request forks into) and free blocks allow; a request that does not fit blocks those
   behind it (strict FCFS).
4. Where the forward pass computes its rows in whole blocks (`row_block`), a step of one-token decodes
   that would start a new block for a few rows leaves those sequences for the next step, in turn.
5. For a model whose every layer sees only the last `window` keys, a sequence's blocks wholly behind the
   window of its next query go back to the pool whenever it is scheduled (_release_behind_window), so a
   long generation holds about window / block_size + 2 blocks, not one per block_size tokens.
Prefix-cache hits are taken on admission: matched full blocks are shared, not recomputed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.prefix_cache import extend_block_hashes, identity_at
from kvserve.engine.sequence import RELEASED_SLOT, SeqStatus, Sequence
from kvserve.intmath import div_ceil


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed to the model this step (includes draft tokens to verify)
    num_logits: int  # trailing rows whose logits are needed (0 for an unfinished prefill chunk)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (src, dst) block copies to run before the forward pass: copy-on-write of shared partial blocks.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        row_block: int | None = None,
        window: int | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Sequence] = []  # sorted by arrival_key
        self.running: list[Sequence] = []  # sorted by arrival_key
        # Keep a reserve of free blocks so admissions do not immediately force preemptions.
        self.watermark_blocks = max(1, pool.num_blocks // 100)
        self.num_preemptions = 0
        # The model's hint (LlamaModel.row_block): the multiple of rows the forward pass computes in whole
        # blocks of, or None where a step's cost follows its row count (_defer_partial_row_block).
        self.row_block = row_block
        self.num_passes = 0  # schedule() calls so far
        self.num_row_block_deferrals = 0  # decode tokens postponed a step by _defer_partial_row_block
        # Set only when no query of any model reading the cache sees a key `window` or more positions back
        # (every layer windowed): blocks behind it are then released (_release_behind_window).
        self.window = window

    # ---- queue management ----
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running set directly (its prompt is already computed)."""
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival_key)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Create a request's other n-1 samples once its prompt is computed; they share the parent's
        blocks (full ones read-only, the partial last one copied on first write, see _reserve)."""
        request = parent.request
        children = []
        for index in range(len(request.sequences), request.params.n):
            child = request.new_sequence(index)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_table = list(parent.block_table)
            child.num_released_blocks = parent.num_released_blocks
            for block in child.held_blocks:
                self.pool.incref(block)
            child.block_hashes = list(parent.block_hashes)
            self.add_running(child)
            children.append(child)
        return children

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_all_blocks(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one iteration ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = list(self.running)
        decoders_left = sum(1 for s in running if not s.in_prefill)
        scheduled_ids: set[int] = set()
        index = 0
        while index < len(running):
            seq = running[index]
            index += 1
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this pass
            self._release_behind_window(seq)
            decoding = not seq.in_prefill
            if decoding:
                decoders_left -= 1
                want = 1 + len(seq.spec_tokens)
                if want > budget:
                    seq.spec_tokens = seq.spec_tokens[: max(budget - 1, 0)]
                    want = 1 + len(seq.spec_tokens)
            else:
                want = min(seq.num_tokens - seq.num_computed_tokens, max(budget - decoders_left, 0))
            if want <= 0 or want > budget:
                continue
            while not self._reserve(seq, seq.num_computed_tokens + want, out):
                victim = next(
                    (s for s in reversed(running) if s.status is SeqStatus.RUNNING and s.seq_id not in scheduled_ids),
                    None,
                )
                if victim is None:
                    break
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or not self._has_room(seq, seq.num_computed_tokens + want):
                continue
            scheduled_ids.add(seq.seq_id)
            budget -= want
            reaches_end = seq.num_computed_tokens + want >= seq.num_tokens
            out.scheduled.append(ScheduledSeq(seq, want, want if decoding else _prefill_logits(seq, want, reaches_end)))

        if not out.preempted:
            self._admit_waiting(out, budget)
        self._defer_partial_row_block(out)
        self.num_passes += 1
        return out

    def _defer_partial_row_block(self, out: SchedulerOutput) -> None:
        """Leave a decode-only step's rows past its last whole row block for the next step, when they
        are at most a quarter of a block (or one row).

        From one whole row block on, linear_amx pays for a partial last 16-row tile as for a full one, so
        100 one-token decodes cost the products of 112 rows. Measured, a step with a few rows past a whole
        block gives fewer tokens per second than the step at the block; past a quarter of a block the
        difference is within the noise, so a quarter of a block is where leaving rows out stops paying (figures:
        benchmarks/RESULTS.md, "Figures behind the code's rules").
        Leaving the last few sequences out makes every sequence faster, the ones left out included
        (each waits one step in every rows / tail). Which ones rotates: those left out least recently
        (never: first), the newest arrivals first among equals. A sequence still waiting for its first
        token is never left out. The blocks reserved for a left-out sequence's token stay in its table
        for the next step; a copy-on-write already planned still runs (its table points at the copy).
        """
        block, rows = self.row_block, len(out.scheduled)
        if block is None or rows <= block:
            return
        tail = rows % block  # rows past the last whole block
        if not 0 < tail <= max(1, block // 4):
            return
        if any(item.num_new_tokens != 1 for item in out.scheduled):
            return  # prefill chunks or draft tokens: rows no longer one per sequence
        candidates = [item for item in reversed(out.scheduled) if item.seq.num_output_tokens > 0]
        if len(candidates) < tail:
            return
        least_recently = sorted(candidates, key=lambda item: item.seq.last_deferred_pass)
        deferred = {item.seq.seq_id for item in least_recently[:tail]}
        self.num_row_block_deferrals += len(deferred)
        for item in out.scheduled:
            if item.seq.seq_id in deferred:
                item.seq.last_deferred_pass = self.num_passes
        out.scheduled = [item for item in out.scheduled if item.seq.seq_id not in deferred]

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if sum(map(_seq_slots, self.running)) + _seq_slots(seq) > self.max_num_seqs and self.running:
                break
            hits = self._match_prefix(seq) if seq.num_computed_tokens == 0 else []
            computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
            remaining = seq.num_tokens - computed
            if self.enable_chunked_prefill:
                want = min(remaining, budget)
            elif remaining > budget and out.scheduled:
                break
            else:
                # Without chunking a whole prompt runs at once; one larger than the budget runs alone.
                want = remaining
            blocks_needed = div_ceil(computed + want, self.block_size) - len(hits)
            # Hits behind the window go back to the pool at once: only the others are taken from it.
            revived = sum(1 for b in hits[self._num_dead_blocks(computed) :] if self.pool.is_free(b))
            if self.pool.num_free - (blocks_needed + revived) < self.watermark_blocks and (
                self.running or out.scheduled or self.pool.num_free < blocks_needed + revived
            ):
                break
            self.waiting.pop(0)
            for block in hits:
                self.pool.incref(block)
            seq.block_table = list(hits)
            seq.num_computed_tokens = computed
            if seq.num_preemptions == 0:
                # A request's first admission (forked samples are only admitted after a preemption):
                # count it once, however long it waited, and keep its report when it is recomputed.
                seq.request.num_cached_tokens = computed
                if self.pool.enable_caching:
                    self.pool.stats.queries += seq.num_tokens
                    self.pool.stats.hits += computed
            self._release_behind_window(seq)  # hits behind the window: back to the pool, still cached
            for _ in range(blocks_needed):
                seq.block_table.append(self.pool.allocate())
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival_key)
            budget -= want
            out.scheduled.append(ScheduledSeq(seq, want, _prefill_logits(seq, want, computed + want >= seq.num_tokens)))

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks matching the sequence's tokens.

        At most (num_tokens - 1) // block_size blocks: the last token is always computed (its logits
        are needed), and the block it lands in is then never a shared one.
        """
        if not self.pool.enable_caching or seq.wants_prompt_logits:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, max_blocks, self.block_size, seq.request.cache_key_digest)
        hits: list[int] = []
        for index in range(max_blocks):
            block = self.pool.lookup(identity_at(seq.block_hashes, seq.token_ids, index, self.block_size))
            if block is None:
                break
            hits.append(block)
        return hits

    def _has_room(self, seq: Sequence, total_tokens: int) -> bool:
        return len(seq.block_table) * self.block_size >= total_tokens and not self._needs_copy(seq)

    def _needs_copy(self, seq: Sequence) -> bool:
        """Writing position num_computed_tokens would modify a block another sequence also reads."""
        if seq.num_computed_tokens % self.block_size == 0:
            return False
        block = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.pool.ref_count(block) > 1

    def _reserve(self, seq: Sequence, total_tokens: int, out: SchedulerOutput) -> bool:
        """Make the blocks for positions < total_tokens writable; False if the pool is short."""
        copy = self._needs_copy(seq)
        need = div_ceil(total_tokens, self.block_size) - len(seq.block_table)
        if self.pool.num_free < max(need, 0) + int(copy):
            return False
        if copy:
            slot = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[slot]
            fresh = self.pool.allocate()
            out.block_copies.append((shared, fresh))
            self.pool.free(shared)
            seq.block_table[slot] = fresh
        for _ in range(max(need, 0)):
            seq.block_table.append(self.pool.allocate())
        return True

    def _release_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks whose keys no query of `seq` will see again (only with `window` set).

        The next query is at position num_computed_tokens, which never moves back while the sequence holds
        blocks (a preemption frees them all; rejected drafts are never counted in it), and a query at p sees
        keys p - window + 1 .. p. So every key before num_computed_tokens - window + 1 is dead for good, and
        the blocks wholly before it are released: a full block in the prefix-cache index goes back as a
        cached (evictable) block like any freed one, so a later request can still reuse it. Their slots keep
        RELEASED_SLOT, so that later slots keep their positions (sequence.py's invariant).
        """
        dead = self._num_dead_blocks(seq.num_computed_tokens)
        for slot in range(seq.num_released_blocks, dead):
            self.pool.free(seq.block_table[slot])
            seq.block_table[slot] = RELEASED_SLOT
        seq.num_released_blocks = max(seq.num_released_blocks, dead)

    def _num_dead_blocks(self, num_computed_tokens: int) -> int:
        """How many leading blocks hold only keys no query from num_computed_tokens on sees (0 without a window)."""
        if self.window is None:
            return 0
        return max(num_computed_tokens - self.window + 1, 0) // self.block_size

    def _free_all_blocks(self, seq: Sequence) -> None:
        self.pool.free_blocks(seq.held_blocks)
        seq.block_table = []
        seq.num_released_blocks = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free_all_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.spec_tokens = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    # ---- after the forward pass ----
    def register_computed_blocks(self, seqs: Iterable[Sequence]) -> None:
        """Index blocks that became full this step; only now do their K/V exist for others to reuse."""
        if not self.pool.enable_caching:
            return
        for seq in seqs:
            full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
            if full <= seq.num_registered_blocks:
                continue
            extend_block_hashes(seq.block_hashes, seq.token_ids, full, self.block_size, seq.request.cache_key_digest)
            for index in range(max(seq.num_registered_blocks, seq.num_released_blocks), full):
                identity = identity_at(seq.block_hashes, seq.token_ids, index, self.block_size)
                self.pool.register(seq.block_table[index], identity)
            seq.num_registered_blocks = full


def _prefill_logits(seq: Sequence, num_new_tokens: int, reaches_end: bool) -> int:
    """Logits rows a prefill chunk needs: the last one when it completes the prompt (to sample), every
    row while prompt logprobs are being computed."""
    return num_new_tokens if seq.wants_prompt_logits else int(reaches_end)


def _seq_slots(seq: Sequence) -> int:
    """Running sequences `seq` will count for: a request's first sample forks into n after its prompt."""
    return seq.request.params.n if seq.index == 0 and seq.num_output_tokens == 0 else 1
