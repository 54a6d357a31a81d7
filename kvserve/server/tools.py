"""Tool calling: the default tool prompt, the grammar a call is generated under, and parsing calls
out of the generated text.

Wire format (Hermes-style, as Qwen's and NousResearch's templates write calls): each call is
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
    defs: dict[str, Any] = {}
    alternatives = []
    for f in functions:
        parameters = _hoist_defs(f.get("parameters") or {"type": "object", "properties": {}}, f["name"], defs)
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call_schema: dict[str, Any] = {"anyOf": alternatives, "x-guidance": {"whitespace_pattern": WHITESPACE}}
    if defs:
        call_schema["$defs"] = defs
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
    return StructuredOutput("lark", lark, "tools")


def _hoist_defs(parameters: dict[str, Any], function: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A parameters schema's own $defs (or definitions), moved to the call schema's root under names
    prefixed by the function, with its local $refs rewritten: nested in the call schema, "#/$defs/x"
    would otherwise point at the root's."""
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not local:
        return parameters

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            for prefix in ("#/$defs/", "#/definitions/"):
                if isinstance(ref, str) and ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{function}__{ref.removeprefix(prefix)}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, schema in local.items():
        defs[f"{function}__{name}"] = rewrite(schema)
    return rewrite(parameters)


def parse_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a generated answer: the calls are its complete call blocks; content is the
    text when there are none."""
    calls = [_parse_block(block) for block in _CALL_BLOCK.findall(text)]
    return (None if calls else text), calls


def _parse_block(block: str) -> ParsedCall:
    call = json.loads(block)
    return ParsedCall(new_call_id(), call["name"], json.dumps(call["arguments"]))


# The start of a call's JSON up to its arguments' first character, once that has arrived (the grammar
# puts "name" first).
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still turn out to follow the arguments rather than belong to them: whitespace, the call
# object's closing brace and the start of the closing tag.
_MAYBE_CALL_END = re.compile(
    r"\s*(\}\s*(" + "".join("(" + re.escape(c) for c in CALL_CLOSE) + ")?" * len(CALL_CLOSE) + r")?)?$"
)


class ToolCallStream:
    """One streamed choice's text -> content deltas or tool-call deltas.

    The answer is either text or calls (the grammar sees to it); while what has arrived could still be
    the start of a call tag, nothing is sent. A call's first delta carries its index, id and name as
    soon as the name is complete; its arguments then follow as fragments of the generated JSON text,
    holding back only what may be the end of the call (whitespace, the closing brace and tag).
    """

    def __init__(self) -> None:
        self.pending = ""  # text of the current call (or undecided text) not yet consumed
        self.is_calls: bool | None = None  # None until the first characters decide
        self.num_calls = 0
        self.args_start: int | None = None  # where the current call's arguments begin in pending
        self.args_sent = 0  # characters of the current call's arguments sent

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[ToolCallDelta]]:
        self.pending += text
        if self.is_calls is None:
            if CALL_OPEN.startswith(self.pending) and not finished:
                return None, []
            self.is_calls = self.pending.startswith(CALL_OPEN)
        if not self.is_calls:
            content, self.pending = self.pending, ""
            return content or None, []
        deltas: list[ToolCallDelta] = []
        while self._advance(deltas):
            pass
        return None, deltas

    def _advance(self, deltas: list[ToolCallDelta]) -> bool:
        """Emit what the current call allows; True when a call completed (another may follow)."""
        start = self.pending.find(CALL_OPEN)
        if start < 0:
            return False
        body_start = start + len(CALL_OPEN)
        if self.args_start is None:
            head = _CALL_HEAD.match(self.pending, body_start)
            if head is None:
                return False
            name = json.loads(head.group(1))
            function = FunctionCallDelta(name=name, arguments="")
            deltas.append(ToolCallDelta(index=self.num_calls, id=new_call_id(), type="function", function=function))
            self.args_start, self.args_sent = head.end(), 0
        close = self.pending.find(CALL_CLOSE, self.args_start)
        if close >= 0:  # complete: the arguments end before the call object's closing brace
            args = self.pending[self.args_start : self.pending.rindex("}", 0, close)].rstrip()
        else:
            tail = self.pending[self.args_start :]
            end = _MAYBE_CALL_END.search(tail)
            assert end is not None  # the pattern matches the empty string at the end
            args = tail[: end.start()]
        if len(args) > self.args_sent:
            fragment = FunctionCallDelta(arguments=args[self.args_sent :])
            deltas.append(ToolCallDelta(index=self.num_calls, function=fragment))
            self.args_sent = len(args)
        if close < 0:
            return False
        self.pending = self.pending[close + len(CALL_CLOSE) :]
        self.num_calls += 1
        self.args_start = None
        return True


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
