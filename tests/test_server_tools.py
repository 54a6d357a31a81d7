"""Tool calling and response_format over HTTP, through the official `openai` client, `langchain-openai`
and `litellm`: forced, named, auto, parallel and streamed calls whose arguments validate against the
function's schema; the history's assistant calls and tool messages reach the prompt intact."""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.chat import with_default_tool_prompt
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread
from kvserve.server.tools import CALL_CLOSE, CALL_OPEN, DEFAULT_TOOL_PROMPT, ToolCallStream, call_grammar

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_ARGS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_ARGS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a timezone", "parameters": TIME_ARGS},
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


@pytest.fixture(scope="module")
def server() -> Any:
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32"))).start()
    with ServerThread(build_app(engine)) as running:
        yield running
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def assert_valid_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(deltas: list[Any]) -> list[Any]:
    """Streamed tool-call deltas -> calls, as a client does: the first delta of an index carries its id
    and name, the arguments are the concatenation of every delta's fragment."""
    calls: dict[int, Any] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.id and delta.function.name, "a call's first delta names it"
            calls[delta.index] = SimpleNamespace(
                id=delta.id, function=SimpleNamespace(name=delta.function.name, arguments="")
            )
        else:
            assert delta.id is None and delta.function.name is None
        calls[delta.index].function.arguments += delta.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    return list(calls.values())


def test_streamed_call_fragments_reassemble_at_any_chunking() -> None:
    args = ['{"city": "Pa}ris", "unit": {"x": [1, 2]} }', '{"timezone":"Europe/Paris"}']
    text = (
        f'{CALL_OPEN}{{"name": "get_weather", "arguments": {args[0]}\n  }}\n</tool_call>\n'
        f'{CALL_OPEN}{{"name":"get_time","arguments":{args[1]}}}\n</tool_call>'
    )
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, deltas = ToolCallStream(), []
        for i, piece in enumerate(pieces):
            content, new = stream.feed(piece, finished=i == len(pieces) - 1)
            assert content is None
            deltas += new
        calls = reassemble(deltas)
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("get_weather", args[0]),
            ("get_time", args[1]),
        ]
    text_stream = ToolCallStream()
    assert text_stream.feed("<tool", finished=False) == (None, [])  # could still become a call
    assert text_stream.feed("s are great", finished=False) == ("<tools are great", [])


def test_required_named_and_streamed_calls_validate(client: openai.OpenAI) -> None:
    forced = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=1, max_tokens=200
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.content is None
    assert_valid_calls(forced.choices[0].message.tool_calls, {"get_weather", "get_time"})

    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=100,
    )
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and named.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(calls, {"get_time"})

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200, stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    calls = reassemble(deltas)
    assert len(deltas) > len(calls), "arguments should arrive in fragments"
    assert_valid_calls(calls, {"get_weather", "get_time"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_auto_answers_text_or_valid_calls_and_none_answers_text(client: openai.OpenAI) -> None:
    greeting = [{"role": "user", "content": "Say hello."}]
    for messages in (ASK, greeting):
        auto = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=60, parallel_tool_calls=False
        )
        message = auto.choices[0].message
        if message.tool_calls:
            assert len(message.tool_calls) == 1 and auto.choices[0].finish_reason == "tool_calls"
            assert_valid_calls(message.tool_calls, {"get_weather", "get_time"})
        else:
            assert CALL_OPEN not in message.content
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20
    )
    assert none.choices[0].message.tool_calls in (None, []) and none.choices[0].message.content


def test_history_with_calls_and_tool_results_reaches_the_prompt() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "22 C and sunny", "tool_call_id": "call_1"},
    ]
    rendered = with_default_tool_prompt(messages, [TOOLS[0]])
    assert rendered[0]["role"] == "system" and json.dumps(TOOLS[0]) in rendered[0]["content"]
    assert DEFAULT_TOOL_PROMPT.splitlines()[0] in rendered[0]["content"]
    assert rendered[2]["content"] == CALL_OPEN + '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[3] == messages[2]  # role, content and tool_call_id intact


def test_a_template_that_renders_tools_gets_them_and_the_history_as_sent(server: ServerThread) -> None:
    from kvserve.model.registry import load_model
    from kvserve.server.chat import ChatFlavor
    from kvserve.server.protocol import ChatCompletionRequest

    tokenizer = copy.copy(load_model(MODEL).tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
        "{{ c.function.arguments }}){% endfor %}"
        "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}{% endfor %}"
    )
    assert tokenizer.renders_tools and not load_model(MODEL).tokenizer.renders_tools
    call = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Time?"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "noon", "tool_call_id": "call_9"},
            ],
            "tools": TOOLS,
        }
    )
    [prompt], params = ChatFlavor(tokenizer, 2048, special_tokens_in_content=False).prepare(body)
    assert tokenizer.decode(prompt) == (
        "[tool get_weather][tool get_time]<user>Time?<assistant>(call call_9 get_time {})<tool>noon(answers call_9)"
    )
    assert params.structured is not None and params.structured.kind == "lark"


def test_parameters_with_their_own_defs_keep_their_refs(server: ServerThread) -> None:
    from kvserve.model.registry import load_model
    from kvserve.structured.grammar import new_matcher

    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    send = {"$defs": {"Addr": address}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}}}
    count = {"definitions": {"Addr": {"type": "integer"}}, "type": "object"}
    count["properties"] = {"n": {"$ref": "#/definitions/Addr"}}
    grammar = call_grammar(
        [{"name": "send", "parameters": send}, {"name": "count", "parameters": count}], "required", True
    )
    tokenizer = load_model(MODEL).tokenizer

    def accepted(calls: list[dict]) -> bool:
        ids = tokenizer.encode("".join(CALL_OPEN + json.dumps(c) + CALL_CLOSE for c in calls))
        return new_matcher(grammar, tokenizer).validate_tokens(ids) == len(ids)

    assert accepted([{"name": "send", "arguments": {"to": {"city": "X"}}}, {"name": "count", "arguments": {"n": 3}}])
    assert not accepted([{"name": "count", "arguments": {"n": "three"}}])  # count's Addr, not send's
    assert not accepted([{"name": "send", "arguments": {"to": 3}}])


BAD = [
    ({"tool_choice": "auto"}, "tool_choice is only allowed when tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, "strin"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "at most one"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD)
def test_contradictory_tool_and_format_fields_get_a_400(client: openai.OpenAI, extra: dict, needle: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, **extra}
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(
            **{k: v for k, v in body.items() if k in ("model", "messages", "max_tokens")},
            extra_body={k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")},
        )


def test_response_format_and_vllm_fields_through_the_openai_client(client: openai.OpenAI) -> None:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    ask = [{"role": "user", "content": "Invent a person."}]
    got = client.chat.completions.create(
        model=MODEL, messages=ask, response_format=fmt, temperature=1.0, n=2, max_tokens=80
    )
    for choice in got.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), person)
    choice = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].text in ("yes", "no")
    truncated = "kvserve_structured_output_truncated_total"
    before = _metric(client, truncated)
    cut = client.chat.completions.create(model=MODEL, messages=ask, response_format=fmt, temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "length"
    assert _metric(client, truncated) == before + 1


def _metric(client: openai.OpenAI, name: str) -> float:
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_langchain_bind_tools_and_structured_output(server: ServerThread) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=120)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER_ARGS)
    forced = llm.bind_tools(TOOLS, tool_choice="any").invoke("What time is it in Europe/Paris?")
    for call in forced.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    schema = {"title": "City", "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}}
    schema |= {"required": ["name"], "additionalProperties": False}
    city = llm.with_structured_output(schema, method="json_schema").invoke("Name a city in France.")
    jsonschema.validate(city, schema)


def test_litellm_tool_calls(server: ServerThread) -> None:
    import litellm

    response = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{server.base_url}/v1",
        api_key="unused",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=200,
    )
    assert response.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(response.choices[0].message.tool_calls, {"get_weather", "get_time"})
