"""Constrained decoding: masks against references, end-of-sequence exactly when the value is complete,
bounded whitespace, and the request fields of OpenAI (response_format) and vLLM (guided_*)."""

from __future__ import annotations

import json

import jsonschema
import llguidance.torch as llt
import pytest
import torch

from kvserve import SamplingParams
from kvserve.structured.grammar import StructuredOutput, new_matcher
from kvserve.structured.masks import compute_masks, grammar_penalties, mask_draft_rows

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def allowed_after(matcher, vocab: int) -> torch.Tensor:
    bitmask = llt.allocate_token_bitmask(1, vocab)
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    return grammar_penalties(bitmask, vocab)[0] == 0


def test_bitmask_unpacking_matches_a_bit_by_bit_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    got = grammar_penalties(bitmask, 150) == 0  # wider than the 128 bits: the rest is banned
    for row in range(3):
        for token in range(150):
            bit = token < 128 and (int(bitmask[row, token // 32]) >> (token % 32)) & 1 == 1
            assert bool(got[row, token]) == bit


def test_draft_rows_are_masked_by_the_state_after_the_drafts_before_them(llm_fp32) -> None:
    tokenizer = llm_fp32.tokenizer
    spec = StructuredOutput("json_schema", PERSON)
    drafts = tokenizer.encode('{"name": "Al"') + tokenizer.encode("}")  # "age" is missing: the last draft breaks it
    logits = torch.zeros(len(drafts) + 1, tokenizer.vocab_size)
    matcher = new_matcher(spec, tokenizer)
    masked = mask_draft_rows(logits, matcher, drafts)
    assert not matcher.is_error() and matcher.validate_tokens(drafts) == len(drafts) - 1  # left unmoved
    reference = new_matcher(spec, tokenizer)
    for i in range(len(drafts)):  # rows 0..k-1: the states after drafts[:i], all grammatical
        expected = grammar_penalties(compute_masks([reference], tokenizer.vocab_size), tokenizer.vocab_size)[0] == 0
        assert torch.equal(masked[i] == 0, expected), i
        if i < len(drafts) - 1:
            assert reference.consume_token(drafts[i])
    assert masked[len(drafts) - 1, drafts[-1]] == float("-inf")  # the breaking draft has probability 0


def test_eos_is_allowed_exactly_when_the_value_is_complete(llm_fp32) -> None:
    tokenizer = llm_fp32.tokenizer
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array"}}}
    schema["required"] = ["n"]
    matcher = new_matcher(StructuredOutput("json_schema", schema), tokenizer)
    answer = tokenizer.encode('{"n": 12, "tags": ["a"]}')
    eos = tokenizer.stop_token_ids
    for i, token in enumerate(answer):
        text = tokenizer.decode(answer[:i])
        try:
            jsonschema.validate(json.loads(text), schema)
            complete = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            complete = False
        allowed = allowed_after(matcher, tokenizer.vocab_size)
        assert all(bool(allowed[e]) == complete for e in eos), text
        assert bool(allowed[token])
        assert matcher.consume_token(token)
    allowed = allowed_after(matcher, tokenizer.vocab_size)
    assert allowed.nonzero().flatten().tolist() == eos  # complete and closed: only the end


def test_whitespace_between_json_tokens_is_bounded(llm_fp32) -> None:
    tokenizer = llm_fp32.tokenizer
    matcher = new_matcher(StructuredOutput("json_object"), tokenizer)
    space = tokenizer.encode(" ")[0]
    assert matcher.consume_token(tokenizer.encode("{")[0])
    spaces = 0
    while bool(allowed_after(matcher, tokenizer.vocab_size)[space]):
        assert matcher.consume_token(space)
        spaces += 1
        assert spaces <= 64, "whitespace must be bounded"
    assert spaces >= 1


def test_json_schema_regex_choice_and_grammar_offline(llm_fp32) -> None:
    specs = [
        StructuredOutput("json_schema", PERSON),
        StructuredOutput("json_object"),
        StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
        StructuredOutput("choice", ["yes", "no", "maybe"]),
        StructuredOutput("grammar", 'root ::= "The answer is " ("red" | "green") "."'),
    ]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured=s) for i, s in enumerate(specs)]
    outputs = llm_fp32.chat([ASK] * len(specs), params)
    assert [o.finish_reason for o in outputs] == ["stop"] * len(specs), [o.text for o in outputs]
    jsonschema.validate(json.loads(outputs[0].text), PERSON)
    assert isinstance(json.loads(outputs[1].text), dict)
    assert len(outputs[2].text) == 6 and outputs[2].text[3] == "-"
    assert outputs[3].text in ("yes", "no", "maybe")
    assert outputs[4].text in ("The answer is red.", "The answer is green.")


def test_n_samples_each_follow_the_grammar_and_length_is_counted(llm_fp32) -> None:
    before = llm_fp32.engine.counters.structured_truncated
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=80, structured=StructuredOutput("json_schema", PERSON)
    )
    cut = SamplingParams(temperature=0, max_tokens=3, structured=StructuredOutput("json_schema", PERSON))
    full, short = llm_fp32.chat([ASK, ASK], [params, cut])
    for sample in full.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), PERSON)
    assert short.finish_reason == "length"
    assert llm_fp32.engine.counters.structured_truncated == before + 1


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (StructuredOutput("json_schema", {"type": "strin"}), "strin"),
        (StructuredOutput("regex", "(ab"), "regex"),
        (StructuredOutput("grammar", 'root ::= "a" missing_rule'), "grammar"),
    ],
)
def test_bad_specs_are_refused_on_admission(llm_fp32, spec: StructuredOutput, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        llm_fp32.generate("hi", SamplingParams(structured=spec))
    assert not llm_fp32.engine.has_unfinished_requests()


def test_speculative_decoding_checks_drafts_against_the_grammar(llm_fp32) -> None:
    """n-gram drafts of a constrained request are verified against grammar-masked target rows, so its
    greedy tokens equal a plain engine's; a penalized request decodes without drafts, exactly too."""
    from kvserve import LLM

    copy = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,"
    colors = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6, "maxItems": 6}
    ask = [{"role": "user", "content": "List the colors red, green, blue, red, green, blue as a JSON array."}]
    prompts = [llm_fp32.tokenizer.encode_chat(ask), copy]
    params = [
        SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput("json_schema", colors)),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.0),
    ]
    spec = LLM(dtype="float32", num_kv_blocks=128, speculative={"method": "ngram", "num_tokens": 4, "adaptive": False})
    constrained = spec.generate(prompts[:1], params[:1])[0]
    assert spec.engine.stats()["spec_proposed_tokens"] > 0, "the constrained request should have been drafted"
    penalized = spec.generate(prompts[1:], params[1:])[0]
    expected = llm_fp32.generate(prompts, params)
    assert [constrained.token_ids, penalized.token_ids] == [o.token_ids for o in expected]
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(constrained.text), colors)
