"""Pydantic models of the OpenAI-compatible request and response bodies.

Requests are validated strictly for types (a string where an integer belongs, a bool where a number
belongs, NaN/Infinity are all rejected). Value ranges (temperature >= 0, n >= 1, ...) are checked once,
by `SamplingParams`, so the messages name the field the same way in Python and over HTTP.

Nothing is silently ignored (`fields.py` holds the lists): a field kvserve implements is declared
here; an OpenAI or vLLM field it does not implement is accepted only at its neutral value and
otherwise gets a 400 naming it; a field nobody defines gets a 400 naming it ("unknown field"), except
the few that by definition do not change the answer (`user`, `metadata`, ...). vLLM instead logs and
ignores unknown fields; a 400 was chosen so that a typo (`max_token`) or a setting from another server
cannot return a 200 with the setting not applied.

`user` is accepted and ignored: OpenAI defines it as an end-user id for abuse monitoring, and using it
as a prefix-cache salt would stop the users of one tenant from sharing a system prompt's blocks. The
tenant boundary is `cache_salt` (as in vLLM); without it requests share the cache.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.fields import check_extra_fields
from kvserve.structured.grammar import StructuredOutput

_REQUEST_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool = False
    # vLLM's extension: cumulative usage on every chunk, so clients can count tokens per chunk.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # The schema is always enforced; strict=false (OpenAI: best effort) gets the same guarantee.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    model_config = _REQUEST_CONFIG
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    # Extra fields are collected and judged by check_extra_fields (a 400 unless neutral or harmless).
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    _endpoint: ClassVar[str] = "completions"

    model: str | None = Field(None, description="defaults to the served model")
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="0 or -1 disables top-k")
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = Field(None, description="accepted and ignored; it is not a cache salt")
    cache_salt: str | None = Field(None, description="prefix-cache tenant boundary; absent means no salt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (at most one).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> _SamplingFields:
        check_extra_fields(self.model_extra or {}, self._endpoint)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_token_bias(self.logit_bias),
            structured=self.structured_output(),
        )

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request sets, if any; ValueError when it sets several or a bad one."""
        found: list[StructuredOutput] = []  # each names the field it came from
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(StructuredOutput("json_object", field="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format.json_schema is required when type is 'json_schema'")
            found.append(StructuredOutput("json_schema", fmt.json_schema.schema_, "response_format"))
        so = self.structured_outputs
        candidates = [
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
            ("structured_outputs.json", "json_schema", so.json_ if so else None),
            ("structured_outputs.regex", "regex", so.regex if so else None),
            ("structured_outputs.choice", "choice", so.choice if so else None),
            ("structured_outputs.grammar", "grammar", so.grammar if so else None),
        ]
        for name, kind, spec in candidates:
            if spec is not None:
                value = _json_spec(name, spec) if kind == "json_schema" else spec  # type: ignore[arg-type]
                found.append(StructuredOutput(kind, value, name))
        if so is not None and so.json_object:
            found.append(StructuredOutput("json_object", field="structured_outputs.json_object"))
        if len(found) > 1:
            raise ValueError(
                f"set at most one structured output constraint, got {', '.join(str(s.field) for s in found)}"
            )
        if found and found[0].kind == "choice" and not found[0].spec:
            raise ValueError(f"{found[0].field} must list at least one choice")
        return found[0] if found else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _json_spec(name: str, spec: dict[str, Any] | str) -> dict[str, Any]:
    """vLLM accepts a schema as an object or as its JSON text."""
    if isinstance(spec, dict):
        return spec
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError(f"{name} must be a JSON schema object")
    return schema


def _token_bias(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    bias = {}
    for key, value in (logit_bias or {}).items():
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        bias[int(key)] = value
    return bias


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or a batch of either (one choice per prompt and sample).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    # Prepend the prompt to each choice (and its logprobs, the first token's being null).
    echo: bool = False


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _REQUEST_CONFIG
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    model_config = _REQUEST_CONFIG
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it: plain-text content, OpenAI's developer = system,
        and the tool fields intact (a template that renders tools reads them)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = _REQUEST_CONFIG
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Arguments are always generated under the parameters schema; strict=false gets the same guarantee.
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _REQUEST_CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    _endpoint: ClassVar[str] = "chat"

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is only allowed when tools are given")
            return self
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools")
        if self.tool_mode != "none" and self.structured_output() is not None:
            raise ValueError("tools (with tool_choice other than 'none') cannot be combined with response_format")
        return self

    @property
    def tool_mode(self) -> str:
        """ "none" (no tools, or tool_choice none), "auto", or "required" (also a named function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        return "auto" if self.tool_choice in (None, "auto") else "required"

    def callable_functions(self) -> list[dict[str, Any]]:
        """The functions a call may name: the named one, or all of them."""
        choice = self.tool_choice
        tools = self.tools or []
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == choice.function.name]
        return [t.function.model_dump(exclude_none=True) for t in tools]


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int
    quantization: str  # the weight matrices kept in GGUF blocks, e.g. "Q4_1 x 120, Q8_0 x 1", or "none"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
