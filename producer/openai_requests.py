"""OpenAI's request bodies for `/v1/chat/completions` and `/v1/completions`, and their translation into a
GenerationRequest. No I/O: the gateway, `mlxq batch` and the gateway's batches all use it.

Unknown fields are refused, as OpenAI refuses them; fields OpenAI has and mlxq does not serve (`suffix`,
`best_of` above `n`) are refused by name. mlxq's own sampling fields are accepted next to OpenAI's (the
way vLLM accepts them): `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`logprobs_mode`, and for RL users `return_token_ids` (see producer/openai_responses.py for what it
returns). `priority` picks a priority queue (docs/producer.md).

Agents and evaluators (docs/tools.md): chat takes OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`
and mlxq's `tool_call_format` and `chat_template_kwargs`; completions take `echo` (the prompt's text, and
with `logprobs` its tokens' logprobs, ahead of the completion; `max_tokens` may then be 0) and several
prompts in one request (a job each; choice `i * n + j` is prompt i's j-th); both take `prompt_logprobs`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer.errors import InvalidRequest
from schemas import ChatMessage, GenerationRequest, RequestLimits
from schemas.agents import MAX_PROMPT_LOGPROBS, Tool, ToolChoice
from schemas.constraints import GuidedGrammar, GuidedRegex, ResponseFormat
from schemas.request import MAX_N, MAX_TOP_LOGPROBS, as_invalid_request

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "OpenAIRequest",
    "StreamOptions",
    "parse_openai_request",
    "to_generation_request",
    "to_generation_requests",
]

MAX_PROMPTS = 64  # prompts in one completion request

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """What chat and completions share: OpenAI's sampling fields, then mlxq's extensions. Strict, as
    GenerationRequest: a JSON boolean, number or string where one is expected, never `"yes"` or `"5"`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=512)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, max_length=256)  # accepted and ignored, as a label
    metadata: Optional[dict[str, str]] = None
    # mlxq's extensions
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    logprobs_mode: Optional[Literal["raw", "scaled", "processed"]] = None
    # Structured output (OpenAI's response_format, and mlxq's regex and grammar) and RL's fields, as in
    # GenerationRequest (docs/structured-output.md, docs/rl.md).
    response_format: Optional[ResponseFormat] = None
    guided_regex: Optional[GuidedRegex] = None
    guided_grammar: Optional[GuidedGrammar] = None
    adapter: Optional[str] = Field(None, min_length=1, max_length=256)
    min_weight_version: Optional[int] = Field(None, ge=0, lt=2**53)
    speculative: Optional[bool] = None  # false: no speculative decoding for it (docs/speculative.md)
    return_token_ids: bool = False
    priority: Optional[str] = Field(None, max_length=32)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tools (schemas/agents.py) and the chat template's variables.
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    tool_call_format: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class CompletionRequest(_Common):
    # Text or token ids (OpenAI's list of ints), or several of either (a job each).
    prompt: Union[str, list[int], list[str], list[list[int]]]
    # 0 only with echo: the prompt's logprobs and nothing generated.
    max_tokens: Optional[int] = Field(None, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """Each prompt of the request: one, or several."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]


OpenAIRequest = Union[ChatCompletionRequest, CompletionRequest]

# OpenAI's fields whose names differ in GenerationRequest, or that GenerationRequest has no use for.
_NOT_SAMPLING = {"model", "messages", "prompt", "stream", "stream_options", "user", "max_completion_tokens",
                 "logprobs", "top_logprobs", "return_token_ids", "priority", "echo", "suffix", "best_of"}


def parse_openai_request(path: str, body: Any) -> OpenAIRequest:
    """Validate a decoded JSON body for `path` (CHAT_PATH or COMPLETIONS_PATH); InvalidRequest names the field."""
    model = ChatCompletionRequest if path == CHAT_PATH else CompletionRequest
    if not isinstance(body, dict):
        raise InvalidRequest(f"body: expected a JSON object, got {type(body).__name__}", "body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = as_invalid_request(exc)
        raise InvalidRequest(str(error), error.field) from None


def to_generation_requests(body: OpenAIRequest, limits: RequestLimits | None = None) -> list[GenerationRequest]:
    """The GenerationRequests that serve `body`: one, or one per prompt of a completion with several."""
    if isinstance(body, ChatCompletionRequest) or len(body.prompts) == 1:
        return [to_generation_request(body, limits)]
    if body.stream:
        raise InvalidRequest("prompt: several prompts cannot be streamed; send one per streamed request", "prompt")
    if len(body.prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt: {len(body.prompts)} prompts exceed the limit of {MAX_PROMPTS}", "prompt")
    return [to_generation_request(body.model_copy(update={"prompt": prompt}), limits) for prompt in body.prompts]


def to_generation_request(
    body: OpenAIRequest, limits: RequestLimits | None = None, *, custom_id: str | None = None
) -> GenerationRequest:
    """The GenerationRequest that serves `body`; InvalidRequest (naming the field) for what mlxq cannot serve."""
    payload: dict[str, Any] = {
        name: value for name, value in body.model_dump(exclude_unset=True).items() if name not in _NOT_SAMPLING
    }
    payload = {name: value for name, value in payload.items() if value is not None}
    payload["model"] = body.model
    if isinstance(body, ChatCompletionRequest):
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise InvalidRequest("max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                                 "max_completion_tokens")
        if body.max_completion_tokens is not None:
            payload["max_tokens"] = body.max_completion_tokens
        payload["messages"] = [m.model_dump(exclude_none=True) for m in body.messages]
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequest("top_logprobs: requires logprobs to be true", "top_logprobs")
        if body.logprobs:
            payload["logprobs"] = True
            payload["top_logprobs"] = body.top_logprobs or 0
    else:
        _refuse_unserved_completion_fields(body)
        prompt = body.prompts[0]  # (one prompt, perhaps in a list of one)
        payload.pop("prompt_token_ids", None)
        payload["prompt" if isinstance(prompt, str) else "prompt_token_ids"] = prompt
        if body.logprobs is not None:
            payload["logprobs"] = True
            payload["top_logprobs"] = body.logprobs
        if body.echo:  # the prompt's tokens and their logprobs come back with the result
            payload["prompt_logprobs"] = max(body.logprobs or 0, body.prompt_logprobs or 0)
    if body.stream:
        payload["stream"] = True
    if body.return_token_ids:
        payload["return_prompt_token_ids"] = True
    if custom_id is not None:
        payload["custom_id"] = custom_id
    try:
        return GenerationRequest.validate_payload(payload, limits)
    except Exception as exc:  # InvalidRequestError: same field names as OpenAI's
        field = getattr(exc, "field", None)
        raise InvalidRequest(str(exc), field) from None


def _refuse_unserved_completion_fields(body: CompletionRequest) -> None:
    if len(body.prompts) != 1:
        raise InvalidRequest("prompt: one prompt per request here (the gateway's /v1/completions takes several)",
                             "prompt")
    if body.echo and body.stream:
        raise InvalidRequest("echo: not supported with stream", "echo")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequest("max_tokens: 0 is only allowed with echo (the prompt's logprobs, nothing generated)",
                             "max_tokens")
    if body.suffix:
        raise InvalidRequest("suffix: not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest("best_of: only best_of == n is supported (every sample is returned)", "best_of")
    if not body.prompts[0]:
        raise InvalidRequest("prompt: must not be empty", "prompt")
