"""The /v1/completions flavor: text or token-id prompts (or a batch of them), text choices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import accumulate

from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.async_engine import Prompt
from kvserve.server.limits import prompts_of
from kvserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from kvserve.server.streaming import ChoiceDelta, ResponseMeta

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionsFlavor:
    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer

    def prepare(self, body: CompletionRequest) -> tuple[list[Prompt], SamplingParams]:
        prompts: list[Prompt] = prompts_of(body)
        if body.echo and body.stream:
            raise ValueError("echo is not supported with stream=true")
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
        params = body.sampling_params(max_tokens, body.logprobs)
        if body.echo:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        return prompts, params

    def response(self, meta: ResponseMeta, outputs: list[RequestOutput], usage: Usage) -> CompletionResponse:
        echo = meta.body is not None and meta.body.echo
        choices = []
        for prompt_index, output in enumerate(outputs):
            prompt_text = ""
            if echo:
                prompt_text = (
                    output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)
                )
            for c in output.outputs:
                logprobs: Sequence[TokenLogprob | None] | None = c.logprobs
                if echo and logprobs is not None:
                    logprobs = [*(output.prompt_logprobs or []), *logprobs]
                choice = CompletionChoice(
                    index=prompt_index * meta.n + c.index,
                    text=prompt_text + c.text,
                    logprobs=self._logprobs(logprobs, 0, output.prompt_token_ids[0]),
                    finish_reason=c.finish_reason,
                )
                choices.append(choice)
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta, usage: Usage | None) -> CompletionResponse:
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta.logprobs, delta.text_offset, None),
            finish_reason=delta.finish_reason,
        )
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage)

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage)

    def _logprobs(
        self, entries: Sequence[TokenLogprob | None] | None, offset: int, first_token: int | None
    ) -> CompletionLogprobs | None:
        """An entry is None for the first prompt token (nothing scores it); first_token names it."""
        if entries is None:
            return None
        ids: list[int] = []
        for e in entries:
            token_id = e.token_id if e is not None else first_token
            assert token_id is not None, "an unscored prompt position comes with its token id"
            ids.append(token_id)
        tokens = [self.tokenizer.decode([t]) for t in ids]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob if e is not None else None for e in entries],
            top_logprobs=[
                {self.tokenizer.decode([t]): lp for t, lp in e.top} if e is not None else None for e in entries
            ],
            text_offset=list(accumulate((len(t) for t in tokens[:-1]), initial=offset)),
        )
