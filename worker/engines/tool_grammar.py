"""A forced tool call as a grammar (tool_choice "required" or a named function; docs/tools.md).

The grammar is the call's wrapper in the reply's tool-call format (worker/replies.py) around a JSON
schema per allowed function: its name as a constant and its `parameters` as the arguments. It is
compiled and applied as any structured-output constraint is (worker/engines/constraints.py,
llguidance's Lark with embedded JSON schemas), so even a small model's reply parses as a call to one
of the functions, with arguments that validate against its schema. A marker that is a special token
of the tokenizer (which text cannot spell) is written as that token.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from schemas.agents import Tool
from schemas.constraints import Constraint
from worker.engines.constraints import JSON_OPTIONS
from worker.replies import ToolCallFormat

FIELD = "tool_choice"


def special_token_of(tokenizer: Any) -> Callable[[str], Optional[int]]:
    """A lookup: the id of the added token (special or not) whose text is exactly `marker`, else None.
    llguidance matches every added token as a token, never by its text (Qwen's `<tool_call>` is an
    added token that is not special), so a grammar names such a marker by its id."""
    try:
        added = {str(token): int(token_id) for token_id, token in tokenizer.added_tokens_decoder.items()}
    except AttributeError:  # a tokenizer without added tokens
        added = {}
    return added.get


def forced_call_constraint(call_format: ToolCallFormat, tools: list[Tool], parallel: bool,
                           special_token: Callable[[str], Optional[int]]) -> Constraint:
    """The constraint that makes the reply one call (or, with `parallel`, one or more) to `tools`."""
    if not call_format.forceable:
        raise ValueError(f"{FIELD}: a forced call cannot be made in the {call_format.name!r} tool-call format "
                         "(mlxq forces hermes, llama3_json and mistral; set tool_call_format)")

    def literal(text: str) -> str:
        token = special_token(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    arguments_key = "parameters" if call_format.name == "llama3_json" else "arguments"
    call = _call_schema(tools, arguments_key)
    tagged = {**call, "x-guidance": JSON_OPTIONS}
    if call_format.name == "hermes":
        newline = json.dumps("\n")
        repeat = f" ({newline} call)*" if parallel else ""
        body = f"{literal(call_format.start)} {newline} %json {json.dumps(tagged)} {newline} {literal(call_format.end)}"
        rules = f"start: call{repeat}\ncall: {body}\n"
    elif call_format.name == "llama3_json":
        repeat = ' ("; " call)*' if parallel else ""
        rules = f"start: call{repeat}\ncall: %json {json.dumps(tagged)}\n"
    else:  # mistral: the marker, then a JSON list of calls
        listed = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  "x-guidance": JSON_OPTIONS}
        rules = f"start: {literal(call_format.start)} %json {json.dumps(listed)}\n"
    return Constraint("grammar", "%llguidance {}\n" + rules, FIELD)


def _call_schema(tools: list[Tool], arguments_key: str) -> dict[str, Any]:
    """One call to any of `tools`: {"name": <const>, <arguments_key>: <its parameters>}."""
    options = [{"type": "object",
                "properties": {"name": {"const": tool.function.name}, arguments_key: tool.function.parameters_schema},
                "required": ["name", arguments_key], "additionalProperties": False}
               for tool in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}
