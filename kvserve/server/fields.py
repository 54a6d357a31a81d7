"""Request fields kvserve does not implement: which are harmless, which must keep their neutral value.

Every field a request carries is either implemented (declared in protocol.py), or listed here, or
unknown; an unknown field, or a listed one at a value that would change the answer, gets a 400 that
names it. Nothing is ignored silently.
"""

from __future__ import annotations

from typing import Any

# By definition these never change the tokens generated: labels, end-user ids and cache/routing hints.
HARMLESS = frozenset({"metadata", "safety_identifier", "prompt_cache_key", "service_tier", "store"})

# OpenAI / vLLM fields kvserve does not implement -> the value(s) that mean "off" (None always does).
_COMMON_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "priority": (0,),
    "request_id": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "return_token_ids": (False,),
}
NEUTRAL: dict[str, dict[str, tuple[Any, ...]]] = {
    "completions": {**_COMMON_NEUTRAL, "suffix": ("",)},
    "chat": {
        **_COMMON_NEUTRAL,
        "echo": (False,),
        "functions": ([],),
        "function_call": ("none",),
        "modalities": (["text"],),
        "audio": (),
        "prediction": (),
        "reasoning_effort": (),
        "web_search_options": (),
        "verbosity": (),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "add_special_tokens": (False,),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "documents": ([],),
        "mm_processor_kwargs": ({},),
    },
}


def check_extra_fields(extra: dict[str, Any], endpoint: str) -> None:
    """Raises ValueError naming the first field that kvserve would otherwise have to ignore."""
    neutral = NEUTRAL[endpoint]
    for name, value in extra.items():
        if name in HARMLESS:
            continue
        if name in neutral:
            if value is not None and not any(_same(value, n) for n in neutral[name]):
                raise ValueError(f"{name}={value!r} is not supported by kvserve")
            continue
        raise ValueError(f"unknown field {name!r}: not an OpenAI or vLLM field kvserve implements")


def _same(value: Any, neutral: Any) -> bool:
    # True == 1 in Python; a bool must not pass for a number or the other way round.
    return type(value) is type(neutral) and value == neutral
