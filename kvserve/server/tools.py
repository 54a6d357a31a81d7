"""Tool calling: the default tool prompt, the grammar a call is generated under, and parsing calls
out of the generated text.

Wire format (Hermes-style, what SmolLM2-class models imitate best): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A model whose chat template renders
`tools` itself gets the tools through its template; otherwise (SmolLM2's template does not) the
default prompt below is appended to the system message and earlier assistant calls are written into
their messages in the same format.

tool_choice: "none" generates plain text (the tools are left out of the prompt); "required" and a
named function constrain the whole answer to calls whose arguments follow the function's
`parameters` schema; "auto" lets the answer be text (never containing a call tag) or calls, and a
call, once started, is constrained. parallel_tool_calls=false, or a named function, allows exactly one
call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.server.protocol import FunctionCallDelta, ToolCallDelta
from kvserve.structured.grammar import WHITESPACE, StructuredOutput

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    return DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


def format_call(name: str, arguments: str) -> str:
    """An earlier assistant call, written as the model is asked to write one."""
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments  # shown as the client sent it
    return CALL_OPEN + json.dumps({"name": name, "arguments": args}) + CALL_CLOSE


def call_grammar(functions: list[dict[str, Any]], mode: str, parallel: bool) -> StructuredOutput:
    """mode "required" (functions: all tools, or the one named): only calls; "auto": text or calls."""
    call_schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ],
        "x-guidance": {"whitespace_pattern": WHITESPACE},
    }
    calls = "call+" if parallel else "call"
    start = f"start: {calls}" if mode == "required" else f"start: TEXT | {calls}"
    lark = "\n".join(
        [
            start,
            f"call: {json.dumps(CALL_OPEN)} call_json {json.dumps(CALL_CLOSE)} {json.dumps(chr(10))}?",
            f"call_json: %json {json.dumps(call_schema)}",
            # Text that never contains the opening tag, so a call cannot hide in it unconstrained.
            r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/",
        ]
    )
    return StructuredOutput("lark", lark)


def parse_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a generated answer: the calls are its complete call blocks; content is the
    text when there are none."""
    calls = [_parse_block(block) for block in _CALL_BLOCK.findall(text)]
    return (None if calls else text), calls


def _parse_block(block: str) -> ParsedCall:
    call = json.loads(block)
    return ParsedCall(new_call_id(), call["name"], json.dumps(call["arguments"]))


class ToolCallStream:
    """One streamed choice's text -> content deltas, or tool-call deltas once its calls are complete.

    The answer is either text or calls (the grammar sees to it); while what has arrived could still be
    the start of a call tag, nothing is sent. Each call goes out as one delta (index, id, name and its
    arguments as a single fragment) when its block closes.
    """

    def __init__(self) -> None:
        self.pending = ""
        self.is_calls: bool | None = None  # None until the first characters decide
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[ToolCallDelta]]:
        self.pending += text
        if self.is_calls is None:
            if CALL_OPEN.startswith(self.pending) and not finished:
                return None, []
            self.is_calls = self.pending.startswith(CALL_OPEN)
        if not self.is_calls:
            content, self.pending = self.pending, ""
            return content or None, []
        deltas = []
        while (match := _CALL_BLOCK.search(self.pending)) is not None:
            call = _parse_block(match.group(1))
            function = FunctionCallDelta(name=call.name, arguments=call.arguments)
            deltas.append(ToolCallDelta(index=self.num_calls, id=call.id, type="function", function=function))
            self.num_calls += 1
            self.pending = self.pending[match.end() :]
        return None, deltas


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
