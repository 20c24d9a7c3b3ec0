"""A reply's text split into reasoning, answer and tool calls (docs/tools.md), for any engine.

`ReplyFormat` says how one request's reply is to be read: the model's think tags (and whether the
prompt left a think block open) and, for a request with tools, the tool-call format and the names
of the functions it may call. `ReplyParser` splits one choice's text as it grows: what it hands out
(answer, reasoning, completed calls) is final, whatever pieces the text arrived in, so a stream's
deltas add up to the result's fields. Text that could still be the start of a tag or a call is held
back until decided; a call is handed out whole, once its text is complete and parses.

Tool-call formats (`TOOL_CALL_FORMATS`): `hermes` (Hermes / Qwen: `<tool_call>{"name", "arguments"}
</tool_call>`, any number, anywhere in the reply), `llama3_json` (Llama 3.x: the reply is one or
more `{"name", "parameters"}` objects separated by `;`), `mistral` (`[TOOL_CALLS]` then a JSON list
of calls, to the reply's end). Any other name is one of mlx-lm's tool parsers
(`mlx_lm.tool_parsers.<name>`: its start and end markers and its `parse_tool_call`); mlxq can parse
those formats but not force a call in them (worker/engines/tool_grammar.py).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from schemas.agents import FunctionCall, ToolCall

PYTHON_TAG = "<|python_tag|>"


class UnknownToolCallFormat(ValueError):
    """A tool-call format neither mlxq nor mlx-lm knows."""


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # the text that opens a call; "" (llama3_json): a reply that starts with a JSON object is one
    end: str  # the text that closes it; "": the reply's end
    parse: Callable[[str, Any], Any]  # a call's text between them -> {"name", "arguments"} or a list of them
    # Writes calls [(name, arguments)] as the model would (for templates that know no tools); None: cannot.
    render: Optional[Callable[[list[tuple[str, Any]]], str]] = None
    # Whether mlxq can force a call in this format by a grammar (tool_choice required or named).
    forceable: bool = False


def _parse_json_call(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


def _render_hermes(calls: list[tuple[str, Any]]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n"
                     "</tool_call>" for name, arguments in calls)


def _parse_llama3(text: str, tools: Any = None) -> list[Any]:
    """One or more JSON objects, separated by `;` (and whitespace), after an optional python tag."""
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            break
        value, at = decoder.raw_decode(text, at)
        calls.append(value)
    if not calls:
        raise ValueError("no JSON object")
    return calls


def _render_llama3(calls: list[tuple[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False) for name, arguments in calls)


def _parse_mistral(text: str, tools: Any = None) -> Any:
    from mlx_lm.tool_parsers import mistral

    return mistral.parse_tool_call(text.strip(), tools)


def _render_mistral(calls: list[tuple[str, Any]]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls],
                                       ensure_ascii=False)


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _parse_json_call, _render_hermes, True),
    "llama3_json": ToolCallFormat("llama3_json", "", "", _parse_llama3, _render_llama3, True),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "", _parse_mistral, _render_mistral, True),
}
# mlx-lm's names for the formats above.
_ALIASES = {"json_tools": "hermes"}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format called `name`: mlxq's own, else mlx-lm's parser module of that name."""
    name = _ALIASES.get(name, name)
    if name in TOOL_CALL_FORMATS:
        return TOOL_CALL_FORMATS[name]
    if not name.replace("_", "").isalnum():
        raise UnknownToolCallFormat(f"unknown tool-call format {name!r}")
    try:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        return ToolCallFormat(name, str(module.tool_call_start), str(module.tool_call_end), module.parse_tool_call)
    except (ImportError, AttributeError):
        raise UnknownToolCallFormat(f"unknown tool-call format {name!r} (mlxq's: {', '.join(TOOL_CALL_FORMATS)}; "
                                    "or one of mlx-lm's tool parsers)") from None


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's reply is read."""

    think: Optional[tuple[str, str]] = None  # the model's (start, end) think tags, when its replies may reason
    starts_thinking: bool = False  # the prompt ends inside an open think block
    tools: Optional[ToolCallFormat] = None  # the request's tools are parsed from the reply in this format
    tool_names: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True

    @property
    def active(self) -> bool:
        return self.think is not None or self.tools is not None


@dataclass
class ReplyDelta:
    answer: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def tool_call_id(job_id: str, choice: int, call: int) -> str:
    """A call's id: the same in a job's stream and its result, and unique across jobs."""
    return "call_" + hashlib.sha256(f"{job_id}/{choice}/{call}".encode()).hexdigest()[:24]


class ReplyParser:
    """One choice's reply, split as its text arrives (`feed`, then `finish` once it has ended).
    `answer`, `reasoning`, `calls` and `error` hold everything handed out so far."""

    def __init__(self, reply: ReplyFormat, call_id: Callable[[int], str]) -> None:
        self._format = reply
        self._call_id = call_id
        self._buffer = ""  # text received and not yet handed out
        self._mode = "reasoning" if reply.think and reply.starts_thinking else "begin"
        self._strip_answer = False  # the answer resumes after a tag or a call: its leading whitespace goes
        self._reasoning_started = False
        self._gap = ""  # the whitespace dropped before a call's text: given back if it is no call
        self.answer = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self.error: Optional[str] = None
        self.finished = False  # `finish` was called: nothing is held back any more

    def feed(self, text: str) -> ReplyDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ReplyDelta:
        self.finished = True
        return self._advance(final=True)

    def parse(self, text: str) -> "ReplyParser":
        """The whole of a reply at once."""
        self.feed(text)
        self.finish()
        return self

    # --- the state machine ------------------------------------------------------------------
    def _advance(self, final: bool) -> ReplyDelta:
        delta = ReplyDelta()
        while True:
            step = getattr(self, f"_{self._mode}")
            if not step(delta, final):
                break
        self.answer += delta.answer
        self.reasoning += delta.reasoning
        self.calls += delta.calls
        return delta

    def _begin(self, delta: ReplyDelta, final: bool) -> bool:
        """Nothing of the answer handed out yet: a think block may open, a llama3 call may start."""
        head = self._buffer.lstrip()
        think = self._format.think
        if think and head.startswith(think[0]):
            self._buffer = head[len(think[0]):]
            self._mode = "reasoning"
            return True
        tools = self._format.tools
        whole_reply_call = tools is not None and tools.start == ""
        could_be = (think is not None and think[0].startswith(head)) or (whole_reply_call and PYTHON_TAG.startswith(head))
        if could_be and not final:
            return False
        if whole_reply_call and (head.startswith("{") or head.startswith(PYTHON_TAG)):
            self._mode = "reply_call"
            return True
        if self._strip_answer:
            self._buffer = head
        self._mode = "answer"
        return True

    def _reasoning(self, delta: ReplyDelta, final: bool) -> bool:
        end = self._format.think[1]  # type: ignore[index]
        at = self._buffer.find(end)
        if at >= 0:
            self._hand_reasoning(delta, self._buffer[:at].rstrip())
            self._buffer = self._buffer[at + len(end):]
            self._mode, self._strip_answer = "begin", True
            return True
        if final:  # cut off while reasoning: all of it is reasoning
            self._hand_reasoning(delta, self._buffer.rstrip())
            self._buffer = ""
            return False
        keep = _held_back(self._buffer, end)
        self._hand_reasoning(delta, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _hand_reasoning(self, delta: ReplyDelta, text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        delta.reasoning += text

    def _answer(self, delta: ReplyDelta, final: bool) -> bool:
        tools = self._format.tools
        start = tools.start if tools is not None else ""
        at = self._buffer.find(start) if start else -1
        if at >= 0:
            piece = self._buffer[:at].rstrip()
            self._hand_answer(delta, piece)
            self._gap = self._buffer[len(piece):at]
            self._buffer = self._buffer[at:]
            self._mode = "call"
            return True
        keep = 0 if final or not start else _held_back(self._buffer, start)
        self._hand_answer(delta, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _hand_answer(self, delta: ReplyDelta, text: str) -> None:
        if self._strip_answer:
            text = text.lstrip()
            self._strip_answer = not text
        delta.answer += text

    def _call(self, delta: ReplyDelta, final: bool) -> bool:
        """The buffer starts with a call's opening marker."""
        tools = self._format.tools
        assert tools is not None
        if tools.end:
            at = self._buffer.find(tools.end, len(tools.start))
            if at >= 0:
                raw = self._buffer[: at + len(tools.end)]
                self._buffer = self._buffer[at + len(tools.end):]
                self._mode, self._strip_answer = "answer", self._take_calls(delta, raw, raw[len(tools.start): at])
                return True
        if not final:
            return False
        raw, self._buffer = self._buffer, ""  # unclosed (or closed by the reply's end): to the end
        self._take_calls(delta, raw, raw[len(tools.start):])
        self._mode = "answer"
        return False

    def _reply_call(self, delta: ReplyDelta, final: bool) -> bool:
        """The reply is a call (llama3_json): decided at its end."""
        if not final:
            return False
        raw, self._buffer = self._buffer, ""
        self._take_calls(delta, raw, raw)
        self._mode = "answer"
        return False

    def _take_calls(self, delta: ReplyDelta, raw: str, body: str) -> bool:
        """The calls in `body`, or, if it does not parse as calls to the request's tools, `raw` as
        answer text and the reason in `error`. Whether it parsed."""
        gap, self._gap = self._gap, ""
        try:
            calls = self._parse(body)
        except Exception as exc:  # any parser's failure: the text stays the answer's
            self._hand_answer(delta, gap + raw)
            self.error = self.error or f"{type(exc).__name__}: {exc}"[:500]
            return False
        if not self._format.parallel_tool_calls:
            calls = calls[: max(0, 1 - len(self.calls) - len(delta.calls))]
        for name, arguments in calls:
            index = len(self.calls) + len(delta.calls)
            delta.calls.append(ToolCall(id=self._call_id(index), function=FunctionCall(name=name, arguments=arguments)))
        return True

    def _parse(self, body: str) -> list[tuple[str, str]]:
        tools = self._format.tools
        assert tools is not None
        parsed = tools.parse(body, None)
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ValueError(f"not a call (an object with a name): {str(item)[:200]}")
            name = item["name"]
            if name not in self._format.tool_names:
                raise ValueError(f"the reply calls {name!r}, which is not one of the request's tools")
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError(f"the arguments of {name!r} are not a JSON object")
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            raise ValueError("no call")
        return calls


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` to hold: the longest tail that could begin
    `marker`, and the whitespace before it (dropped if the marker follows)."""
    keep = 0
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            keep = size
            break
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())
