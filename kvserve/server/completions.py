"""The /v1/completions flavor: text or token-id prompts (or a batch of them), text choices."""

from __future__ import annotations

from itertools import accumulate

from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.async_engine import Prompt
from kvserve.server.limits import prompts_of
from kvserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from kvserve.server.streaming import ChoiceDelta, ResponseMeta, choices_of

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionsFlavor:
    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer

    def prepare(self, body: CompletionRequest) -> tuple[list[Prompt], SamplingParams]:
        prompts: list[Prompt] = prompts_of(body)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
        return prompts, body.sampling_params(max_tokens, body.logprobs)

    def response(self, meta: ResponseMeta, outputs: list[RequestOutput], usage: Usage) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=index,
                text=c.text,
                logprobs=self._logprobs(c.logprobs, 0),
                finish_reason=c.finish_reason,
            )
            for index, c in choices_of(outputs, meta.n)
        ]
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta, usage: Usage | None) -> CompletionResponse:
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta.logprobs, delta.text_offset),
            finish_reason=delta.finish_reason,
        )
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage)

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage)

    def _logprobs(self, entries: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
        if entries is None:
            return None
        tokens = [self.tokenizer.decode([e.token_id]) for e in entries]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            text_offset=list(accumulate((len(t) for t in tokens[:-1]), initial=offset)),
        )
