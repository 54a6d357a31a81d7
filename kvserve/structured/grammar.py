"""What a constrained request must produce (`StructuredOutput`) and its grammar for llguidance.

llguidance was chosen over xgrammar by measurement (docs/structured_output.md, benchmarks/
grammar_engines.py): it compiles a new schema far faster, which is what tool calling with
per-request schemas pays for; its per-step mask, the slower of the two, is a small share of a CPU
decode step; and it installs alone, where xgrammar pulls triton.

JSON answers: whitespace between JSON tokens is bounded (WHITESPACE), so an answer cannot run to
max_tokens on blank space; the mask allows end-of-sequence exactly when the value is complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance

from kvserve.model.tokenizer import TokenizerWrapper

# At most one newline and a few spaces or tabs between two JSON tokens: enough for indented output,
# too little to loop on. JSON's other whitespace (\r) is never needed.
WHITESPACE = r"[\x20\x09]{0,8}|\x0A[\x20\x09]{0,16}"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """kind: one of KINDS. spec: the schema (a dict) for json_schema, the pattern for regex, the list of
    strings for choice, the Lark or GBNF text for grammar (llguidance's Lark for lark), None for
    json_object. field: the request field it came from, which an error with the spec names."""

    kind: str
    spec: Any = None
    field: str | None = None

    def grammar(self) -> str:
        """llguidance's grammar text; raises ValueError when the spec cannot be compiled."""
        if self.kind == "json_object":
            return _json_grammar({"type": "object"})
        if self.kind == "json_schema":
            return _json_grammar(self.spec)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.spec))
        if self.kind == "grammar":
            return llguidance.grammar_from("grammar", self.spec)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.spec)
        raise ValueError(f"unknown structured output kind {self.kind!r}")

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


def _json_grammar(schema: Any) -> str:
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_pattern": WHITESPACE}
    )


@lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: TokenizerWrapper) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it (built once: it indexes the whole vocabulary); a constrained
    answer may end with any of the model's end-of-turn tokens."""
    return llguidance.LLTokenizer(
        tokenizer.backend_json(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.stop_token_ids
    )


def new_matcher(structured: StructuredOutput, tokenizer: TokenizerWrapper) -> llguidance.LLMatcher:
    """A matcher at the start of the grammar; raises ValueError naming the problem with the spec."""
    what = f"{structured.field} ({structured.kind})" if structured.field else structured.kind
    try:
        grammar = structured.grammar()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid {what}: {exc}") from exc
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid {what}: {matcher.get_error()}")
    return matcher
