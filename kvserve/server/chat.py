"""The /v1/chat/completions flavor: messages through the model's chat template, assistant-message choices."""

from __future__ import annotations

import dataclasses
from typing import Any

from jinja2 import TemplateError

from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
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
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    TopLogprob,
    Usage,
)
from kvserve.server.streaming import ChoiceDelta, ResponseMeta, choices_of
from kvserve.server.tools import ParsedCall, ToolCallStream, call_grammar, format_call, parse_calls, tools_prompt


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
        messages = [m.template_dict() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_mode != "none" else None
        template_tools = None
        if self.tokenizer.renders_tools:
            template_tools = tools
        else:
            messages = with_default_tool_prompt(messages, tools)
        try:
            prompt_ids = self.tokenizer.encode_chat(
                messages, tools=template_tools, special_tokens_in_content=self.special_tokens_in_content
            )
        except TemplateError as exc:
            raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        if max_tokens is None:  # as vLLM: all the room the context and the KV pool leave one sequence
            max_tokens = max(self.max_sequence_len - len(prompt_ids), 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs)
        if body.tool_mode != "none":
            # A named function is called exactly once (as vLLM and OpenAI do); otherwise parallel unless refused.
            parallel = body.parallel_tool_calls is not False and not isinstance(body.tool_choice, NamedToolChoice)
            grammar = call_grammar(body.callable_functions(), body.tool_mode, parallel)
            params = dataclasses.replace(params, structured=grammar)  # re-validated (ignore_eos, min_tokens)
        return [prompt_ids], params

    def response(self, meta: ResponseMeta, outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        with_tools = _tool_mode(meta) != "none"
        choices = []
        for index, c in choices_of(outputs, meta.n):
            content, calls = parse_calls(c.text) if with_tools else (c.text, [])
            message = AssistantMessage(content=content, tool_calls=[_tool_call(call) for call in calls])
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(
                ChatChoice(index=index, message=message, logprobs=self._logprobs(c.logprobs), finish_reason=finish)
            )
        return ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta, usage: Usage | None) -> ChatCompletionChunk:
        # The role rides on each choice's first chunk, which also carries its first text, so no chunk
        # goes out before the model has produced anything (clients time the first token by it).
        content, tool_calls, finish = delta.text or None, None, delta.finish_reason
        if _tool_mode(meta) != "none":
            stream = meta.stream_state.setdefault(delta.index, ToolCallStream())
            content, new_calls = stream.feed(delta.text, finished=delta.finish_reason is not None)
            tool_calls = new_calls or None
            if stream.num_calls and finish == "stop":
                finish = "tool_calls"
        choice = ChatStreamChoice(
            index=delta.index,
            delta=ChatDelta(role="assistant" if delta.first else None, content=content, tool_calls=tool_calls),
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=finish,
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


def _tool_mode(meta: ResponseMeta) -> str:
    return meta.body.tool_mode if isinstance(meta.body, ChatCompletionRequest) else "none"


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def with_default_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """For a template that does not render tools: the tool prompt joins the system message (one is
    created first), and earlier assistant calls are written into their content as the model writes
    them. Tool messages keep role "tool" and their tool_call_id."""
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            text = "\n".join(filter(None, [message["content"], *calls]))
            message = {**message, "content": text}
        rendered.append(message)
    if tools:
        prompt = tools_prompt(tools)
        if rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered
