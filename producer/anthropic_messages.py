"""Anthropic's Messages API (`POST /v1/messages`) over mlxq's queue, without I/O (docs/tools.md): its request
body into a GenerationRequest, a result into its Message, a job's stream events into its stream events,
and its error shape.

What translates: `system` (a string or text blocks) to a system message; user text and images (base64
or data-URL sources) to a user message; `tool_result` blocks to tool messages (first, as Anthropic
puts them); assistant text, `tool_use` and `thinking` blocks to an assistant message with tool calls
and reasoning; `tools` (`name`, `description`, `input_schema`) to function tools; `tool_choice` `auto`,
`any` (required), `tool` (named), `none`, with `disable_parallel_tool_use`; `thinking` enabled or
disabled to the chat template's `enable_thinking`; `output_config.format` (a JSON schema) to
`response_format` (`effort` is ignored); `stop_sequences`, `temperature`, `top_p`, `top_k`,
`max_tokens`, `metadata.user_id` (ignored). `cache_control` marks are accepted and ignored (mlxq's
prefix cache needs none). mlxq's own `seed`, `guided_regex`, `guided_grammar`, `chat_template_kwargs`
and `tool_call_format` are taken as on its OpenAI routes. A reply's reasoning is a `thinking` block (with an empty signature), its
tool calls `tool_use` blocks; stop reasons `end_turn`, `max_tokens`, `stop_sequence`, `tool_use`.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from producer.errors import InvalidRequest
from schemas import GenerationRequest, GenerationResult, RequestLimits
from schemas.agents import TOOL_NAME_PATTERN

__all__ = ["MESSAGES_PATH", "MessagesRequest", "MessageStreamWriter", "anthropic_error", "build_message",
           "to_generation_request"]

MESSAGES_PATH = "/v1/messages"


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: Optional[dict[str, Any]] = None  # accepted, ignored


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: Optional[list[dict[str, Any]]] = None


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(max_length=256)
    name: str = Field(max_length=256)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=256)
    content: Union[str, list[Union[TextBlock, ImageBlock]], None] = None
    is_error: Optional[bool] = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[dict[str, Any]] = None


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None
    display: Optional[str] = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Optional[OutputFormat] = None
    effort: Optional[str] = None  # accepted, ignored


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=512)
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    tools: Optional[list[ToolParam]] = None
    tool_choice: Optional[ToolChoiceParam] = None
    thinking: Optional[ThinkingParam] = None
    output_config: Optional[OutputConfig] = None
    metadata: Optional[dict[str, Any]] = None  # user_id: accepted, ignored
    cache_control: Optional[dict[str, Any]] = None
    # mlxq's own, as on its OpenAI routes (docs/tools.md).
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tool_call_format: Optional[str] = None


def to_generation_request(body: MessagesRequest, limits: RequestLimits | None = None) -> GenerationRequest:
    """The GenerationRequest that serves `body`; InvalidRequest naming the field for what cannot be served."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        messages += (_assistant if message.role == "assistant" else _user)(blocks, f"messages[{i}]")
    if body.messages[-1].role == "assistant":
        raise InvalidRequest("messages: a last assistant message (prefill) is not supported", "messages")
    payload: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
                               "stream": body.stream}
    for name in ("temperature", "top_p", "top_k", "seed", "guided_regex", "guided_grammar", "tool_call_format"):
        if getattr(body, name) is not None:
            payload[name] = getattr(body, name)
    if body.stop_sequences:
        payload["stop"] = body.stop_sequences
    if body.tools:
        payload["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description} if t.description else {})}}
                            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise InvalidRequest("tool_choice.name: required with type tool", "tool_choice.name")
        payload["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                  else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            payload["parallel_tool_calls"] = False
    if body.output_config is not None and body.output_config.format is not None:
        payload["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None and body.thinking.type != "adaptive":
        kwargs["enable_thinking"] = body.thinking.type == "enabled"
    if kwargs:
        payload["chat_template_kwargs"] = kwargs
    try:
        return GenerationRequest.validate_payload(payload, limits)
    except Exception as exc:  # InvalidRequestError: name the Anthropic field where it differs
        field = {"stop": "stop_sequences"}.get(getattr(exc, "field", None) or "", getattr(exc, "field", None))
        raise InvalidRequest(str(exc).replace("stop:", "stop_sequences:"), field) from None


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results as tool messages, then the rest as one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            text = block.content if isinstance(block.content, str) else "".join(
                b.text for b in block.content or () if isinstance(b, TextBlock))
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {text}" if block.is_error else text})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source, f"{where}.content[{j}]")}})
        else:
            raise InvalidRequest(f"{where}.content[{j}]: a {block.type} block belongs to assistant messages",
                                 f"{where}.content")
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
    return out


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):
            raise InvalidRequest(f"{where}.content[{j}]: a {block.type} block belongs to user messages",
                                 f"{where}.content")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return [{k: v for k, v in message.items() if v is not None}]


def _image_url(source: ImageSource, where: str) -> str:
    if source.type == "base64" and source.data and source.media_type:
        return f"data:{source.media_type};base64,{source.data}"
    if source.type == "url" and source.url:
        return source.url
    raise InvalidRequest(f"{where}.source: base64 needs media_type and data, url needs url", f"{where}.source")


# --- responses ----------------------------------------------------------------------------------

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def stop_reason(finish_reason: Optional[str], stop_sequence: Optional[str]) -> Optional[str]:
    if finish_reason == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason or "", "end_turn")


def build_message(body: MessagesRequest, job_id: str, result: GenerationResult) -> dict[str, Any]:
    """The Message answering `body`, from its job's (finished) result."""
    choice = result.choices[0] if result.choices else None
    content: list[dict[str, Any]] = []
    if choice is not None:
        if choice.reasoning_content:
            content.append({"type": "thinking", "thinking": choice.reasoning_content, "signature": ""})
        if choice.text or not choice.tool_calls:
            content.append({"type": "text", "text": choice.text})
        for call in choice.tool_calls or ():
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                            "input": json.loads(call.function.arguments)})
    return {"id": f"msg_{job_id}", "type": "message", "role": "assistant", "model": body.model, "content": content,
            "stop_reason": stop_reason(choice.finish_reason, choice.stop_sequence) if choice else "end_turn",
            "stop_sequence": choice.stop_sequence if choice else None,
            "usage": {"input_tokens": result.usage.prompt_tokens, "output_tokens": result.usage.completion_tokens}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class MessageStreamWriter:
    """One streamed Message: Anthropic's events, as (event name, data) pairs, from a job's stream events.
    Each kind of text opens its own content block (thinking, text), each complete tool call a
    tool_use block with its arguments in one input_json_delta."""

    def __init__(self, body: MessagesRequest, job_id: str) -> None:
        self.body = body
        self.id = f"msg_{job_id}"
        self._index = -1  # the open block's index
        self._open: Optional[str] = None  # its type

    def opening(self) -> list[tuple[str, dict[str, Any]]]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message})]

    def token(self, event: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if event.get("reasoning_content"):
            out += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": event["reasoning_content"]}))
        if event.get("text"):
            out += self._into("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event["text"]}))
        for call in event.get("tool_calls") or ():
            out += self._into(None, None)
            out += self._into("tool_use", {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                           "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return out

    def closing(self, result: GenerationResult) -> list[tuple[str, dict[str, Any]]]:
        out = self._into(None, None)
        if self._index < 0:  # nothing was said: one empty text block, as a blocking answer would have
            out += self._into("text", {"type": "text", "text": ""}) + self._into(None, None)
        choice = result.choices[0] if result.choices else None
        finish = choice.finish_reason if choice else None
        sequence = choice.stop_sequence if choice else None
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason(finish, sequence), "stop_sequence": sequence},
                                      "usage": {"input_tokens": result.usage.prompt_tokens,
                                                "output_tokens": result.usage.completion_tokens}}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _into(self, kind: Optional[str], block: Optional[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """Close the open block unless it is of `kind`; open a `block` of `kind` if none is open."""
        out: list[tuple[str, dict[str, Any]]] = []
        if self._open is not None and self._open != kind:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None
        if kind is not None and self._open is None:
            self._index += 1
            self._open = kind
            out.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                                "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
