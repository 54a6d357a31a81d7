"""Request body -> token-id prompts and SamplingParams, on a small thread pool of its own.

Rendering a chat template and tokenizing take time in proportion to the text. Done on the event loop, a
long message froze /health and every other endpoint; done on the engine thread, a long prompt stopped
generation for everyone. Here the size limits are checked first, on the loop (limits.py: no text is
scanned), then the rest runs on `tokenizer_threads` worker threads (the tokenizer releases the GIL while
it encodes), and the engine receives token ids only.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvserve.engine.input_processor import Prompt
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.limits import FieldError, RequestLimits, param_of, request_texts
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.streaming import Flavor


class InputProcessor:
    def __init__(self, tokenizer: TokenizerWrapper, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._pool = ThreadPoolExecutor(limits.limits.tokenizer_threads, thread_name_prefix="kvserve-tokenize")

    async def __call__(
        self, flavor: Flavor, body: CompletionRequest | ChatCompletionRequest
    ) -> tuple[list[list[int]], SamplingParams]:
        """Raises ValueError naming the field when the request is too large or malformed."""
        self.limits.check(body)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, flavor, body)

    def _prepare(self, flavor: Flavor, body: CompletionRequest | ChatCompletionRequest) -> tuple:
        for name, text in request_texts(body):
            require_unicode(name, text)
        prompts, params = flavor.prepare(body)
        return [self._token_ids(prompt) for prompt in prompts], params

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise ValueError("prompt must not be empty")
        return self.tokenizer.encode(prompt, add_special_tokens=True)


def require_unicode(name: str, text: str) -> None:
    """Raise ValueError when text holds a lone surrogate (JSON's "\\ud800"): it is not Unicode text, and
    the tokenizer cannot encode it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(
            param_of(name),
            f"{name} holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}; "
            "send valid Unicode text",
        ) from None
