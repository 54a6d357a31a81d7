"""Reading one OpenAI-style streamed response (server-sent events) into emission times.

Tokens per chunk are counted, in order of preference, from the cumulative ``usage`` the server
puts on chunks (kvserve and vLLM with ``continuous_usage_stats``; llama.cpp on its final chunk),
from the chunk's logprobs entries, or as one per chunk with text — never by re-tokenizing text,
which undercounts whenever decode(encode(x)) != x. A later cumulative usage reconciles chunks
counted one each before it, so the total always matches the server's own count when it gives one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON payload of a ``data:`` line, ``DONE`` for the terminator, None for anything else
    (blank separators, comments, ``event:`` lines)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    return json.loads(data)


@dataclass
class StreamCounter:
    """Accumulates one response's chunks; ``chat`` selects delta.content over text."""

    chat: bool
    token_times: list[float] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    done: bool = False

    def feed(self, payload: dict[str, Any] | str, t: float) -> None:
        """Account for one parsed event received at time ``t``."""
        if payload == DONE:
            self.done = True
            return
        assert isinstance(payload, dict)
        if "error" in payload and not payload.get("choices"):
            err = payload["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        choices = payload.get("choices") or []
        choice = choices[0] if choices else {}
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        if text:
            self.text_parts.append(text)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

        usage = payload.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            count, source = max(0, usage["completion_tokens"] - len(self.token_times)), "usage"
        elif logprob_count := _logprob_count(choice.get("logprobs"), self.chat):
            count, source = logprob_count, "logprobs"
        else:
            count, source = (1 if text else 0), "chunks"
        if count:
            self.token_times.extend([t] * count)
            self.sources.add(source)
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.cached_tokens = cached

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def count_source(self) -> str | None:
        return "+".join(sorted(self.sources)) or None

    @property
    def finished(self) -> bool:
        """The server said the response is complete (a finish reason, or the [DONE] event)."""
        return self.done or self.finish_reason is not None


def _logprob_count(logprobs: Any, chat: bool) -> int:
    """Tokens a chunk's logprobs describe: ``tokens`` (completions) or ``content`` (chat)."""
    if not isinstance(logprobs, dict):
        return 0
    entries = logprobs.get("content") if chat else logprobs.get("tokens")
    return len(entries) if isinstance(entries, list) else 0
