"""One request's state (`Request`) and the state of each of its samples (`Sequence`).

A request with n > 1 starts as one sequence; when its prompt has been computed it forks into n
sequences that share the prompt's KV blocks (copy-on-write), each then generating on its own.

Invariants of a Sequence:
- token_ids = prompt tokens + output tokens; only accepted tokens are ever appended;
- num_computed_tokens <= len(token_ids): positions below it have K/V in the blocks of block_table,
  except the released slots below;
- len(block_table) * block_size >= num_computed_tokens;
- block_table[:num_released_blocks] are released slots holding RELEASED_SLOT (only for a model whose every
  layer is windowed, Scheduler._release_behind_window): no query the sequence will still make sees a key
  in them; block_table[num_released_blocks:] (held_blocks) each hold one reference to a pool block;
- block_hashes[i] is the chained hash of full block i of token_ids (computed lazily, never changes).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import llguidance
import torch

from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.stop_matcher import StopMatcher, failure_table
from kvserve.model.tokenizer import IncrementalDetokenizer, TokenizerWrapper
from kvserve.structured.grammar import new_matcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()

# What a released block-table slot holds: a valid block id, so that a backend gathering whole tables still
# indexes inside the cache; its keys (another sequence's, maybe) never reach a result (kernels/metadata.py
# says how each backend keeps them out).
RELEASED_SLOT = 0


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # sample index within the request (0..n-1)
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Leading slots of block_table given back to the pool: their keys are behind every future query's window.
    num_released_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # Full blocks already offered to the prefix cache index.
    num_registered_blocks: int = 0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Length of detokenizer.text that is safe to show: never a stop string or a prefix of one.
    visible_text_len: int = 0
    # Where matching of the stop strings stands (created at the first output token when there are stops).
    stop_matcher: StopMatcher | None = None
    # Draft tokens proposed for this step; verified (and dropped) within the same step.
    spec_tokens: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # With structured output: the grammar state after this sample's output tokens (None otherwise).
    matcher: llguidance.LLMatcher | None = None
    # The scheduler pass that last left this sequence out to keep a step in whole row blocks (-1: none).
    last_deferred_pass: int = -1

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def held_blocks(self) -> list[int]:
        """The pool blocks this sequence holds a reference to: its block table past the released slots."""
        return self.block_table[self.num_released_blocks :]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and not all computed yet: every prefill row needs its logits,
        and the prompt is not taken from the prefix cache (a cached position has no logits)."""
        request = self.request
        return self.params.prompt_logprobs is not None and len(request.prompt_logprobs) < self.num_prompt_tokens

    @property
    def arrival_key(self) -> tuple[float, int, int]:
        """FCFS priority: earlier arrival first; ties by request then sample order."""
        return (self.request.metrics.arrival_time, self.request.order, self.index)

    @property
    def text(self) -> str:
        return self.detokenizer.text[: self.visible_text_len]

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            token_times=list(self.token_times),
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            stop_reason=self.stop_reason,
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    cache_salt: str | None
    # Digest of the prefix-cache key (model fingerprint, adapter, salt) every block hash includes.
    cache_key_digest: bytes
    order: int  # admission order among requests with equal arrival times
    base_seed: int
    tokenizer: TokenizerWrapper
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    # KMP tables of params.stop, built once for all n samples (at the first output token).
    stop_tables: list[list[int]] | None = None
    # One entry per prompt token computed so far when prompt_logprobs is set; the first token has none.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def new_sequence(self, index: int) -> Sequence:
        generator = torch.Generator(device="cpu")
        # Each sample owns its generator, so its draws never depend on what else shares the batch.
        generator.manual_seed((self.base_seed * 1_000_003 + index) % (2**63))
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=self.params.skip_special_tokens)
        detok.prefix_offset = detok.read_offset = len(self.prompt_token_ids)
        seq = Sequence(
            request=self,
            index=index,
            token_ids=list(self.prompt_token_ids),
            num_prompt_tokens=len(self.prompt_token_ids),
            generator=generator,
            detokenizer=detok,
        )
        if self.params.structured is not None:
            seq.matcher = new_matcher(self.params.structured, self.tokenizer)
        self.sequences.append(seq)
        return seq

    def new_stop_matcher(self) -> StopMatcher:
        if self.stop_tables is None:
            self.stop_tables = [failure_table(stop) for stop in self.params.stop]
        return StopMatcher(self.params.stop, self.stop_tables)

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)

    def to_output(self) -> RequestOutput:
        outputs = [s.to_output() for s in sorted(self.sequences, key=lambda s: s.index)]
        self.metrics.token_times = outputs[0].token_times if outputs else []
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            error=self.error,
            prompt_logprobs=list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None,
        )
