"""Pydantic models of the OpenAI-compatible request and response bodies.

Requests are validated strictly for types (a string where an integer belongs, a bool where a number
belongs, NaN/Infinity are all rejected) while unknown fields are ignored, as OpenAI does. Value ranges
(temperature >= 0, n >= 1, ...) are checked once, by `SamplingParams`, so the messages name the field
the same way in Python and over HTTP. Fields that would change the meaning of a request but that
kvserve does not implement are accepted only at their neutral value (see `_reject_unsupported`).

`user` is accepted and ignored: OpenAI defines it as an end-user id for abuse monitoring, and using it
as a prefix-cache salt would stop the users of one tenant from sharing a system prompt's blocks. The
tenant boundary is `cache_salt` (as in vLLM); without it requests share the cache.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.engine.sampling_params import SamplingParams

_REQUEST_CONFIG = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool = False
    # vLLM's extension: cumulative usage on every chunk, so clients can count tokens per chunk.
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = _REQUEST_CONFIG
    # Unsupported field -> the only value it may have (None is always allowed).
    _neutral: ClassVar[dict[str, Any]] = {
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": {},
    }

    model: str | None = Field(None, description="defaults to the served model")
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="0 or -1 disables top-k")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = Field(None, description="accepted and ignored; it is not a cache salt")
    cache_salt: str | None = Field(None, description="prefix-cache tenant boundary; absent means no salt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _SamplingFields:
        for name, neutral in self._neutral.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name}={value!r} is not supported by kvserve")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    _neutral: ClassVar[dict[str, Any]] = {**_SamplingFields._neutral, "echo": False, "suffix": ""}

    # A string, a list of token ids, or a batch of either (one choice per prompt and sample).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template expects it: plain-text content, OpenAI's developer = system."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    _neutral: ClassVar[dict[str, Any]] = {
        **_SamplingFields._neutral,
        "tools": [],
        "response_format": {"type": "text"},
    }

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


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
    top_logprobs: list[dict[str, float]] | None = None
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
    content: str


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
