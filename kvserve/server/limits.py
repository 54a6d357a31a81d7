"""What one HTTP request may ask of the server, checked before any tokenizing (`kvserve serve` flags).

Every limit is a field of `ServerLimits` with its default and its flag. `check_request` costs O(number of
fields), never O(characters): it runs on the event loop, so that an oversized request is refused without
being tokenized. The character checks that need a pass over the text (lone surrogates) run with the
tokenizer, off the event loop (inputs.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from kvserve.engine.input_processor import Prompt
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class ServerLimits:
    """Limits and input policy of the HTTP front end. A field's flag is `--` + its name with dashes."""

    max_request_body_bytes: int = field(
        default=16 * 2**20,
        metadata={"help": "request bodies past this are refused (413) without being read further"},
    )
    max_prompt_chars: int | None = field(
        default=None,
        metadata={
            "help": "characters of one prompt, or of all chat messages together (default: max_model_len times the "
            "longest token's length in bytes, so a longer text could never fit the context)"
        },
    )
    max_messages: int = field(default=1024, metadata={"help": "chat messages in one request"})
    max_stop_strings: int = field(default=16, metadata={"help": "stop strings in one request"})
    max_stop_string_chars: int = field(default=1024, metadata={"help": "characters of one stop string"})
    max_choices: int = field(default=256, metadata={"help": "prompts x n of one request (the choices it returns)"})
    header_timeout_s: float = field(
        default=10.0, metadata={"help": "a connection that has not sent a request's full headers by then is closed"}
    )
    max_header_bytes: int = field(default=64 * 2**10, metadata={"help": "request line and headers together"})
    body_timeout_s: float = field(
        default=60.0, metadata={"help": "a request body not received in full by then is refused (408)"}
    )
    tokenizer_threads: int = field(
        default=2, metadata={"help": "threads that render chat templates and tokenize, beside the event loop"}
    )
    allow_special_tokens_in_messages: bool = field(
        default=False,
        metadata={
            "help": "let control strings in chat message text (e.g. <|im_start|>) become control tokens; "
            "off, they are tokenized as plain text and a message cannot forge a turn"
        },
    )
    retained_free_memory_bytes: int = field(
        default=256 * 2**20,
        metadata={"help": "freed heap the process keeps for reuse after a large request; the rest goes to the OS"},
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "max_prompt_chars" and value is None or isinstance(value, bool):
                continue
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")


def add_server_limit_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    for f in fields(ServerLimits):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        kind = float if "float" in f.type else int
        help_ = f.metadata["help"] if f.default is None else f"{f.metadata['help']} (default: {f.default})"
        parser.add_argument(flag, type=kind, default=f.default, help=help_)


def server_limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})


class FieldError(ValueError):
    """A bad request value; param is the top-level field it is in (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def param_of(field_name: str) -> str:
    """The top-level field of a path like messages[2].content[0].text."""
    return field_name.split("[", 1)[0].split(".", 1)[0]


def too_long(field_name: str, length: int, limit: int, unit: str, flag: str) -> FieldError:
    return FieldError(param_of(field_name), f"{field_name} has {length} {unit}; at most {limit} are allowed (--{flag})")


@dataclass
class RequestLimits:
    """ServerLimits resolved for one served model."""

    limits: ServerLimits
    max_model_len: int
    max_prompt_chars: int

    def check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """Raise ValueError naming the field when a size limit is passed; O(fields), no text is scanned."""
        limits = self.limits
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > limits.max_stop_strings:
            raise too_long("stop", len(stops), limits.max_stop_strings, "strings", "max-stop-strings")
        for i, stop in enumerate(stops):
            if len(stop) > limits.max_stop_string_chars:
                limit = limits.max_stop_string_chars
                raise too_long(f"stop[{i}]", len(stop), limit, "characters", "max-stop-string-chars")
        if isinstance(body, ChatCompletionRequest):
            self._check_messages(body)
            num_prompts = 1
        else:
            num_prompts = self._check_prompts(body)
        if num_prompts * body.n > limits.max_choices:
            raise FieldError(
                "n",
                f"n must be at most {limits.max_choices // num_prompts} with {num_prompts} prompt(s), got {body.n}: "
                f"prompts x n is at most {limits.max_choices} (--max-choices)",
            )

    def _check_messages(self, body: ChatCompletionRequest) -> None:
        if len(body.messages) > self.limits.max_messages:
            raise too_long("messages", len(body.messages), self.limits.max_messages, "entries", "max-messages")
        chars = sum(len(text) for _, text in message_texts(body))
        if chars > self.max_prompt_chars:
            raise too_long("messages", chars, self.max_prompt_chars, "characters of content", "max-prompt-chars")

    def _check_prompts(self, body: CompletionRequest) -> int:
        prompts = prompts_of(body)
        for i, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
                raise too_long(name, len(prompt), self.max_prompt_chars, "characters", "max-prompt-chars")
            if isinstance(prompt, list) and len(prompt) >= self.max_model_len:
                raise FieldError(
                    "prompt",
                    f"{name} is {len(prompt)} tokens; the model's context (max_model_len) is {self.max_model_len}, "
                    "which must also leave room for at least one output token",
                )
        return len(prompts)


def prompts_of(body: CompletionRequest) -> list[Prompt]:
    """One prompt is a string or a list of ids; anything else is a batch (one choice group per prompt)."""
    prompt = body.prompt
    single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)
    return [prompt] if single else list(prompt)  # type: ignore[list-item, arg-type]


def message_texts(body: ChatCompletionRequest) -> Iterator[tuple[str, str]]:
    """(field name, text) of every piece of message content."""
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            yield f"messages[{i}].content", message.content
        elif message.content is not None:
            for j, part in enumerate(message.content):
                yield f"messages[{i}].content[{j}].text", part.text


def request_texts(body: CompletionRequest | ChatCompletionRequest) -> Iterator[tuple[str, str]]:
    """(field name, text) of every client string the server reads: prompts, message content, stops, salt."""
    if isinstance(body, ChatCompletionRequest):
        yield from message_texts(body)
    else:
        prompts = prompts_of(body)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                yield ("prompt" if len(prompts) == 1 else f"prompt[{i}]"), prompt
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    for i, stop in enumerate(stops):
        yield f"stop[{i}]", stop
    if body.cache_salt is not None:
        yield "cache_salt", body.cache_salt
