"""The /v1/completions flavor: text or token-id prompts (or a batch of them), text choices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import accumulate

from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.limits import prompts_of
from kvserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from kvserve.server.streaming import ChoiceDelta, ResponseMeta

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionsFlavor:
    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer

    def prepare(self, body: CompletionRequest) -> tuple[list[Prompt], SamplingParams]:
        prompts: list[Prompt] = prompts_of(body)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
        params = body.sampling_params(max_tokens, body.logprobs)
        if body.echo:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        return prompts, params

    def response(self, meta: ResponseMeta, outputs: list[RequestOutput], usage: Usage) -> CompletionResponse:
        echo = meta.body is not None and meta.body.echo
        choices = []
        for prompt_index, output in enumerate(outputs):
            prompt_text, prompt_logprobs = self._echoed(output) if echo else ("", [])
            for c in output.outputs:
                logprobs: Sequence[TokenLogprob | None] | None = c.logprobs
                if logprobs is not None:
                    logprobs = [*prompt_logprobs, *logprobs]
                choice = CompletionChoice(
                    index=prompt_index * meta.n + c.index,
                    text=prompt_text + c.text,
                    logprobs=self._logprobs(logprobs, 0, output.prompt_token_ids[0]),
                    finish_reason=c.finish_reason,
                )
                choices.append(choice)
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta, usage: Usage | None) -> CompletionResponse:
        """With echo, a choice's first chunk starts with the prompt (and its logprobs), so the chunks joined
        equal the non-streamed choice; later chunks' text offsets count the prompt."""
        text, offset = delta.text, delta.text_offset
        logprobs: Sequence[TokenLogprob | None] | None = delta.logprobs
        echo = meta.body is not None and meta.body.echo
        if echo and delta.first:
            prompt_text, prompt_logprobs = self._echoed(delta.request)
            meta.stream_state[delta.index] = len(prompt_text)
            text = prompt_text + text
            logprobs = [*prompt_logprobs, *logprobs] if logprobs is not None else None
        elif echo:
            offset += meta.stream_state[delta.index]
        choice = CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=self._logprobs(logprobs, offset, delta.request.prompt_token_ids[0]),
            finish_reason=delta.finish_reason,
        )
        return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage)

    def _echoed(self, output: RequestOutput) -> tuple[str, list[TokenLogprob | None]]:
        """The prompt's text and its logprobs (the first position unscored: None), as echo returns them."""
        text = output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)
        return text, list(output.prompt_logprobs or [])

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
