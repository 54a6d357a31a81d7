"""Admission of a request's input: a prompt as text or token ids, checked with its sampling parameters
against the model and the KV pool, before anything is queued.

Every refusal is a ValueError naming the field it is about (the server turns it into a 400), so a bad
request never reaches the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvserve.config import EngineConfig
from kvserve.engine.sampling_params import SamplingParams
from kvserve.intmath import div_ceil
from kvserve.model.tokenizer import TokenizerWrapper

# A prompt as text or as token ids.
Prompt = str | Seq[int]


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; the caller should retry later."""


class InputProcessor:
    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        vocab_size: int,
        max_model_len: int,
        num_kv_blocks: int,
        config: EngineConfig,
        release_window: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.config = config
        self.release_window = release_window  # the scheduler's: blocks behind it go back to the pool

    def most_blocks_held(self, num_tokens: int) -> int:
        """The most KV blocks one sample of `num_tokens` tokens (prompt and output) holds at once: one per
        block_size tokens, unless the scheduler releases the blocks behind the window (every layer
        windowed) and prefill runs in chunks. Then a step holds the keys its first query sees (window - 1
        before it) and the step's own tokens (at most max_num_batched_tokens), which may straddle one more
        block. Without chunks a preempted sample recomputes all of its tokens in one step."""
        block_size = self.config.block_size
        whole = div_ceil(num_tokens, block_size)
        if self.release_window is None or not self.config.enable_chunked_prefill:
            return whole
        one_step = self.release_window - 1 + self.config.max_num_batched_tokens
        return min(whole, div_ceil(one_step, block_size) + 1)

    def process(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as ids) and token ids, once prompt and params fit."""
        prompt_text, prompt_ids = self.tokenize(prompt)
        self.check_lengths(len(prompt_ids), params)
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name} names a token id outside the vocabulary [0, {self.vocab_size})")
        return prompt_text, prompt_ids

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        """The prompt leaves room for max_tokens in the context, and one sample's blocks fit the pool."""
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt is {prompt_len} tokens; the model's context (max_model_len) is {self.max_model_len}, "
                "which must also leave room for at least one output token"
            )
        if prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} with a {prompt_len}-token prompt exceeds the model's context "
                f"of {self.max_model_len} tokens"
            )
        limit = min(self.config.max_n, self.config.max_num_seqs)
        if params.n > limit:
            raise ValueError(f"n must be at most {limit} (max_n, max_num_seqs), got {params.n}")
        blocks = self.most_blocks_held(prompt_len + params.max_tokens)
        if blocks > self.num_kv_blocks:
            raise ValueError(f"prompt + max_tokens needs {blocks} KV blocks but the pool has only {self.num_kv_blocks}")
