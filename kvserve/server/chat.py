"""The /v1/chat/completions flavor: messages through the model's chat template, assistant-message choices."""

from __future__ import annotations

from jinja2 import TemplateError

from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.async_engine import Prompt
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)
from kvserve.server.streaming import ChoiceDelta, ResponseMeta, choices_of


class ChatFlavor:
    def __init__(self, tokenizer: TokenizerWrapper, max_sequence_len: int, special_tokens_in_content: bool) -> None:
        # The tokenizer is only read (encode/decode hold no state), so any thread may use it while the
        # engine thread does; the LLMEngine itself is never touched here.
        self.tokenizer = tokenizer
        self.max_sequence_len = max_sequence_len
        self.special_tokens_in_content = special_tokens_in_content

    def prepare(self, body: ChatCompletionRequest) -> tuple[list[Prompt], SamplingParams]:
        if not body.messages:
            raise ValueError("messages must not be empty")
        try:
            messages = [m.template_dict() for m in body.messages]
            prompt_ids = self.tokenizer.encode_chat(messages, self.special_tokens_in_content)
        except TemplateError as exc:
            raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        if max_tokens is None:  # as vLLM: all the room the context and the KV pool leave one sequence
            max_tokens = max(self.max_sequence_len - len(prompt_ids), 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return [prompt_ids], body.sampling_params(max_tokens, logprobs)

    def response(self, meta: ResponseMeta, outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(c.logprobs),
                finish_reason=c.finish_reason,
            )
            for index, c in choices_of(outputs, meta.n)
        ]
        return ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta, usage: Usage | None) -> ChatCompletionChunk:
        # The role rides on each choice's first chunk, which also carries its first text, so no chunk
        # goes out before the model has produced anything (clients time the first token by it).
        choice = ChatStreamChoice(
            index=delta.index,
            delta=ChatDelta(role="assistant" if delta.first else None, content=delta.text or None),
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage)

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage)

    def _logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if entries is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **self._top(e.token_id, e.logprob).model_dump(),
                    top_logprobs=[self._top(t, lp) for t, lp in e.top],
                )
                for e in entries
            ]
        )

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
