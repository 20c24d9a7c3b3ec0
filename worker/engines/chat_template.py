"""A text model's chat template and how its replies read (docs/tools.md): `ChatFormat`, one per engine.

- The prompt: chat messages (with an assistant's tool calls and the tools' answers) and the request's
  tools go through the model's chat template (mlx-lm's tokenizer `apply_chat_template`), with the
  request's `chat_template_kwargs`. A template that takes no tools (it never mentions them) gets them
  in a system message that describes them and the call format, and earlier calls and their answers
  as text in that format.
- The tool-call format: the worker's setting (MLXQ_TOOL_CALL_FORMAT) unless "auto"; else the one
  mlx-lm inferred from the template or the tokenizer's config; else read from the template (Llama
  3.x's JSON calls, Mistral's marker, Hermes / Qwen tags); else hermes. A request's
  `tool_call_format` overrides it.
- Reasoning: the model's think tags as mlx-lm finds them in the vocabulary (MLXQ_REASONING=none
  turns the split off); a prompt that ends inside an open think block starts its reply reasoning.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from schemas import ChatMessage, GenerationRequest
from schemas.constraints import Constraint
from worker.engines.tool_grammar import forced_call_constraint, special_token_of
from worker.replies import ReplyFormat, ToolCallFormat, UnknownToolCallFormat, tool_call_format

REASONING_SETTINGS = ("auto", "none")


class RequestRejected(ValueError):
    """The request cannot run on this model; the message names the field."""


class ChatFormat:
    def __init__(self, tokenizer: Any, *, tool_call_format: str = "auto", reasoning: str = "auto") -> None:
        if reasoning not in REASONING_SETTINGS:
            raise ValueError(f"MLXQ_REASONING must be auto or none, got {reasoning!r}")
        self._tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self._template = template if isinstance(template, str) else json.dumps(template) if template else ""
        self.takes_tools = "tools" in self._template
        self.tool_format = self._configured_format(tool_call_format)
        think = (getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None))
        self.think = think if reasoning == "auto" and think[0] and think[1] else None
        self._think_ids = (tuple(getattr(tokenizer, "think_start_tokens", None) or ()),
                           tuple(getattr(tokenizer, "think_end_tokens", None) or ()))
        self._special_token = special_token_of(tokenizer)

    def _configured_format(self, setting: str) -> ToolCallFormat:
        if setting != "auto":
            try:
                return tool_call_format(setting)
            except UnknownToolCallFormat as exc:
                raise ValueError(f"MLXQ_TOOL_CALL_FORMAT: {exc}") from None
        parser = getattr(self._tokenizer, "tool_parser", None)
        if parser is not None and getattr(parser, "__module__", "").startswith("mlx_lm.tool_parsers."):
            try:
                return tool_call_format(parser.__module__.rsplit(".", 1)[-1])
            except UnknownToolCallFormat:
                pass
        if "[TOOL_CALLS]" in self._template:
            return tool_call_format("mistral")
        if "<|python_tag|>" in self._template or '"parameters": dictionary' in self._template:
            return tool_call_format("llama3_json")
        return tool_call_format("hermes")

    def request_format(self, request: GenerationRequest) -> ToolCallFormat:
        if request.tool_call_format is None:
            return self.tool_format
        try:
            return tool_call_format(request.tool_call_format)
        except UnknownToolCallFormat as exc:
            raise RequestRejected(f"tool_call_format: {exc}") from None

    # --- the prompt -------------------------------------------------------------------------
    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's input as token ids: ids as given, a raw prompt, or chat messages (and
        tools) through the chat template."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return list(self._tokenizer.encode(request.prompt))
        assert request.messages is not None
        if not getattr(self._tokenizer, "has_chat_template", False):
            raise RequestRejected("messages: this model has no chat template; send `prompt` or `prompt_token_ids`")
        for i, message in enumerate(request.messages):
            if not isinstance(message.content, (str, type(None))) and any(p.type != "text" for p in message.content):
                raise RequestRejected(
                    f"messages[{i}].content: image parts need a vision model; this worker serves a text model")
        text = self.render(request)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def render(self, request: GenerationRequest) -> str:
        """The chat template's text for the request's messages and tools."""
        assert request.messages is not None
        messages = [_template_message(m) for m in request.messages]
        tools = request.template_tools
        has_tool_history = any(m.tool_calls or m.role == "tool" for m in request.messages)
        if not self.takes_tools and (tools or has_tool_history):
            messages = self._tools_as_text(messages, tools, self.request_format(request))
            tools = None
        try:
            text = self._tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                       tokenize=False, **(request.chat_template_kwargs or {}))
        except Exception as exc:  # a template's own raise_exception, or one that cannot take these messages
            raise RequestRejected(f"messages: the model's chat template refused them: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}") from None
        return str(text)

    def _tools_as_text(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                       call_format: ToolCallFormat) -> list[dict[str, Any]]:
        """Messages for a template that takes no tools: the tools described in the system message,
        calls written in `call_format`, consecutive tool answers in one user message."""
        render = call_format.render
        if render is None:
            raise RequestRejected(f"tool_call_format: {call_format.name!r} cannot be described to a model whose "
                                  "chat template takes no tools (use hermes, llama3_json or mistral)")
        out: list[dict[str, Any]] = []
        for message in messages:
            role = message["role"]
            if role == "assistant" and message.get("tool_calls"):
                written = render([(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]])
                text = _text_of(message.get("content"))
                out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
            elif role == "tool":
                answer = f"<tool_response>\n{_text_of(message.get('content'))}\n</tool_response>"
                if out and out[-1].get("_tool_answers"):
                    out[-1]["content"] += "\n" + answer
                else:
                    out.append({"role": "user", "content": answer, "_tool_answers": True})
            else:
                out.append(message)
        for message in out:
            message.pop("_tool_answers", None)
        if tools:
            described = _describe_tools(tools, render)
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{_text_of(out[0].get('content'))}\n\n{described}"}
            else:
                out.insert(0, {"role": "system", "content": described})
        return out

    # --- the reply --------------------------------------------------------------------------
    def reply_format(self, request: GenerationRequest, prompt_ids: list[int]) -> Optional[ReplyFormat]:
        """How the reply is read: reasoning split from a chat reply of a thinking model, tool calls
        parsed where the request has tools; None where the text is the answer as it is."""
        think = self.think if request.messages is not None else None
        tools = self.request_format(request) if request.parses_tool_calls else None
        if think is None and tools is None:
            return None
        return ReplyFormat(think=think, starts_thinking=think is not None and self._ends_thinking(prompt_ids),
                           tools=tools, tool_names=frozenset(t.function.name for t in request.tools or ()),
                           parallel_tool_calls=request.parallel_tool_calls)

    def _ends_thinking(self, prompt_ids: list[int]) -> bool:
        start, end = self._think_ids
        return bool(start) and _rfind(prompt_ids, start) > _rfind(prompt_ids, end)

    def forced_call(self, request: GenerationRequest) -> Optional[Constraint]:
        """The grammar of a forced tool call (tool_choice required or named), else None."""
        tools = request.forced_tools
        if tools is None:
            return None
        named = not isinstance(request.tool_choice, str)
        return forced_call_constraint(self.request_format(request), tools, request.parallel_tool_calls and not named,
                                      self._special_token)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: a call's arguments as an object (the convention
    templates follow), content "" where an assistant message only calls."""
    out = message.model_dump(exclude_none=True, exclude={"refusal"})
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in message.tool_calls]
        out.setdefault("content", "")
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _describe_tools(tools: list[dict[str, Any]], render: Any) -> str:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = render([("<function name>", {"<argument>": "<value>"})])
    return ("You can call functions to help with the request. Their signatures, one JSON object a line:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            f"To call a function, reply with the call written exactly like this:\n{example}\n"
            "You may make several calls. Their results come back in <tool_response></tool_response> tags.")


def _rfind(tokens: list[int], pattern: tuple[int, ...]) -> int:
    """Where `pattern` last occurs in `tokens`; -1 if nowhere."""
    size = len(pattern)
    if size == 1:
        try:
            return len(tokens) - 1 - tokens[::-1].index(pattern[0])
        except ValueError:
            return -1
    for at in range(len(tokens) - size, -1, -1):
        if tuple(tokens[at : at + size]) == pattern:
            return at
    return -1
