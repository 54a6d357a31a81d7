"""Acceptance: every schema of the corpus (tests/schema_corpus.py) gets answers that validate and end
with finish_reason "stop", at temperature 0 and 1, all generated in one batch on the real model.
max_tokens is far above what any answer needs, so it is never what ends one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve import SamplingParams
from kvserve.structured.grammar import StructuredOutput
from tests.schema_corpus import CORPUS

pytestmark = pytest.mark.slow


def test_corpus_is_large_and_valid() -> None:
    assert len(CORPUS) >= 50
    for _, schema in CORPUS:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_answer_validates_and_stops(llm_fp32) -> None:
    conversations, params = [], []
    for temperature in (0.0, 1.0):
        for index, (task, schema) in enumerate(CORPUS):
            ask = f"Reply with JSON only: {task}. Schema: {json.dumps(schema)}"
            conversations.append([{"role": "user", "content": ask}])
            structured = StructuredOutput("json_schema", schema)
            params.append(SamplingParams(temperature=temperature, seed=index, max_tokens=400, structured=structured))
    outputs = llm_fp32.chat(conversations, params)
    failures = []
    for (task, schema), output in zip(CORPUS + CORPUS, outputs, strict=True):
        try:
            assert output.finish_reason == "stop", f"finish_reason {output.finish_reason}"
            jsonschema.validate(json.loads(output.text), schema)
        except (AssertionError, json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append(f"{task}: {str(exc)[:120]} in {output.text[:200]!r}")
    assert not failures, "\n".join(failures)
