"""What agents and evaluators send beyond plain generation (docs/tools.md): OpenAI's function tools and
tool choice, tool calls in chat history and in results, arguments for the chat template, and the
log-probabilities of the prompt's own tokens.

`GenerationRequest` takes these fields from `AgentFields` (schemas/request.py); `ChatMessage` checks
its tool fields with `check_tool_message`. Which tool-call format a reply is parsed in, and whether a
tool call is forced by a grammar, is the worker's business (worker/replies.py,
worker/engines/tool_grammar.py): only it knows the model's chat template.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.constraints import check_schema_size, compact_json

MAX_TOOLS = 128
MAX_TOOL_CALLS = 64  # calls in one assistant message of the history
MAX_TOOL_DESCRIPTION_CHARS = 8192
MAX_PROMPT_LOGPROBS = 20  # top entries per prompt token
MAX_CHAT_TEMPLATE_KWARGS = 16
MAX_CHAT_TEMPLATE_KWARGS_CHARS = 8192  # their values as compact JSON
# OpenAI's rule for function names (Anthropic's is the same).
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
TOOL_CHOICES = ("auto", "none", "required")
# apply_chat_template's own parameters: a request may not set them through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "kwargs",
})
_IDENTIFIER = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: Optional[str] = Field(None, max_length=MAX_TOOL_DESCRIPTION_CHARS)
    # A JSON schema of the arguments (an object). None: the function takes no arguments.
    parameters: Optional[dict[str, Any]] = None
    # Accepted for OpenAI compatibility: a forced call's arguments always follow `parameters`.
    strict: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _check_size(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is not None:
            check_schema_size(value)
        return value

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema: `parameters`, or an empty object for a function without them."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Strict):
    """OpenAI's function tool: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(_Strict):
    """`{"type": "function", "function": {"name": ...}}`: that function must be called."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]


class FunctionCall(_Strict):
    name: str = Field(max_length=256)
    # The arguments as JSON text (OpenAI's shape: a string, not an object).
    arguments: str


class ToolCall(_Strict):
    """A call the assistant made: in the history a client sends back, and in a result's choice."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class AgentFields(BaseModel):
    """GenerationRequest's fields for tools, the chat template and prompt log-probabilities."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # The functions the model may call. With `messages` they reach the model through its chat
    # template; with every input the reply is parsed for calls to them (unless tool_choice is "none").
    tools: Optional[list[Tool]] = Field(None, max_length=MAX_TOOLS)
    # "auto" (the default with tools): the model decides; "none": no tools in the prompt and no
    # parsing; "required" or a named function: a call is forced by constrained decoding.
    tool_choice: Optional[ToolChoice] = None
    # False: at most one call (a forced call's grammar allows one; a parsed reply keeps its first).
    parallel_tool_calls: bool = True
    # The tool-call format to parse and force, instead of the one the worker picked from the model's
    # chat template (MLXQ_TOOL_CALL_FORMAT): hermes, llama3_json, mistral, or one of mlx-lm's parsers.
    tool_call_format: Optional[str] = Field(None, pattern=r"^[a-z][a-z0-9_]{0,31}$")
    # Extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # The log-probability of each prompt token under the model (and that many top entries per
    # token; 0: the token's own only): the result's `prompt_logprobs`. With it, max_tokens may be 0.
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is None:
            return value
        if len(value) > MAX_CHAT_TEMPLATE_KWARGS:
            raise ValueError(f"{len(value)} entries, over the limit of {MAX_CHAT_TEMPLATE_KWARGS}")
        for name in value:
            if not _IDENTIFIER.match(name):
                raise ValueError(f"{name!r} is not a template variable name (letters, digits, underscores)")
            if name in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"{name!r} is set by mlxq, not by the request")
        size = len(compact_json(value))
        if size > MAX_CHAT_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"{size} characters as JSON, over the limit of {MAX_CHAT_TEMPLATE_KWARGS_CHARS}")
        return value

    @model_validator(mode="after")
    def _check_tools(self) -> "AgentFields":
        tools = self.tools or []
        names = [tool.function.name for tool in tools]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ValueError(f"tools: the function name {duplicate!r} appears more than once")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: {choice.function.name!r} is not one of the request's tools")
        if choice == "required" and not tools:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.forced_tools and getattr(self, "constraint", None) is not None:
            field = self.constraint.field.split(".")[0]  # type: ignore[attr-defined]
            raise ValueError(f"tool_choice: a forced tool call cannot be combined with {field}")
        if self.forced_tools and getattr(self, "ignore_eos", False):
            raise ValueError("ignore_eos: cannot be combined with a forced tool call, which ends where the call does")
        if getattr(self, "max_tokens", None) == 0:
            if self.prompt_logprobs is None:
                raise ValueError("max_tokens: 0 (no generation) needs prompt_logprobs")
            if getattr(self, "n", 1) != 1:
                raise ValueError("n: max_tokens 0 scores the prompt once; n must be 1")
        return self

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the reply is parsed for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> Optional[list[Tool]]:
        """The tools one of which must be called (tool_choice "required" or named), else None."""
        choice = self.tool_choice
        if not self.tools or choice is None or choice in ("auto", "none"):
            return None
        if isinstance(choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == choice.function.name]
        return list(self.tools)

    @property
    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools as the chat template takes them (None: none for the prompt)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def check_tool_message(role: str, content: Any, tool_calls: Optional[list[ToolCall]],
                       tool_call_id: Optional[str]) -> None:
    """A chat message's tool fields fit its role: calls on assistant messages only, a tool message
    answers a call by its id, and content may be missing only where an assistant message calls."""
    if tool_calls is not None and role != "assistant":
        raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {role}")
    if tool_call_id is not None and role != "tool":
        raise ValueError(f"tool_call_id: only tool messages answer a call, not {role}")
    if role == "tool" and tool_call_id is None:
        raise ValueError("tool_call_id: a tool message names the call it answers")
    if content is None and not (role == "assistant" and tool_calls):
        raise ValueError("content: required (only an assistant message with tool_calls may leave it out)")
