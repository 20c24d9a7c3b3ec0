"""GenerationRequest: what a producer enqueues. Strict: unknown fields and out-of-range
values are rejected, and every error names the field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from schemas.agents import MAX_TOOL_CALLS, AgentFields, ToolCall, check_tool_message
from schemas.constraints import (
    Constraint,
    GuidedGrammar,
    GuidedRegex,
    ResponseFormat,
    constraint_fields_given,
    constraint_of,
)
from schemas.payload import ShapeError, check_shape

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class RequestLimits:
    """Operator-set caps, checked on top of the schema's fixed ranges.

    Producers pass them to validation (`GenerationRequest.validate_payload(d, limits)`);
    the worker re-checks them, plus the prompt's token length, which only it can count.
    """

    max_tokens: int = 4096
    max_prompt_tokens: int = 32768
    max_prompt_chars: int = 1_000_000
    max_messages: int = 2048
    max_images: int = 8  # image_url parts per request
    # An inline image's decoded size (the worker checks every source). Its base64 takes 4/3 of it in the
    # job, which a worker refuses whole above MLXQ_MAX_JOB_BYTES (16 MiB).
    max_image_bytes: int = 10 * 1024 * 1024
    # What one result may hold: n x max_tokens x (1 + top_logprobs) token entries (`result_entries`).
    # A result takes about 60 bytes of JSON per entry (docs/requests.md), so this bounds one result key
    # near 8 MiB, and what a gateway holds to serve it.
    max_result_entries: int = 131072


class InvalidRequestError(ValueError):
    """A request failed validation. `field` is the dotted path of the first bad field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, except on an assistant message that makes tool calls.
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    # Tools (schemas/agents.py): an assistant's calls; a tool message's answer to one, by its id. An
    # assistant's earlier reasoning, and OpenAI's refusal echoed back, are taken (templates may show them).
    tool_calls: Optional[list[ToolCall]] = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: Optional[str] = Field(None, max_length=256)
    reasoning_content: Optional[str] = None
    refusal: Optional[str] = None

    @model_validator(mode="after")
    def _check_tool_fields(self) -> "ChatMessage":
        check_tool_message(self.role, self.content, self.tool_calls, self.tool_call_id)
        return self


class GenerationRequest(AgentFields):
    """One generation job. Exactly one of `prompt`, `messages`, `prompt_token_ids`.

    Tools, tool choice, chat-template arguments and prompt log-probabilities are AgentFields'
    (schemas/agents.py).

    `max_tokens=None` means the worker's default (`MLXQ_DEFAULT_MAX_TOKENS`).
    Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1. `top_k=0` and `min_p=0`
    disable those filters.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    prompt_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(None, min_length=1)

    model: Optional[str] = Field(None, min_length=1, max_length=512)
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: only with prompt_logprobs (schemas/agents.py)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # JSON object keys are strings: token ids arrive as "123" and are coerced here only.
    logit_bias: Optional[
        dict[Annotated[int, Strict(False), Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]]
    ] = Field(None, max_length=1024)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=MAX_N)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    # "raw": the model's own distribution (log-softmax of its logits). "scaled": the same at the
    # request's temperature, untruncated. "processed": the exact distribution the token was drawn from
    # (after logit_bias, penalties, a constraint's mask, temperature, top-p/min-p/top-k, renormalised).
    logprobs_mode: Literal["raw", "scaled", "processed"] = "raw"
    return_prompt_token_ids: bool = False
    stream: bool = False
    ignore_eos: bool = False
    custom_id: Optional[str] = Field(None, max_length=512)
    metadata: Optional[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]] = (
        Field(None, max_length=16)
    )
    # RL (docs/rl.md): a LoRA adapter the worker serves, by name; the lowest weight version that may run it.
    adapter: Optional[str] = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:/-]+$")
    min_weight_version: Optional[int] = Field(None, ge=0, lt=2**53)
    # false: this request never speculates, on a worker that does (docs/speculative.md); its tokens are
    # the same either way, only the speed differs.
    speculative: bool = True
    # Structured output (schemas/constraints.py, docs/structured-output.md): at most one per request.
    response_format: Optional[ResponseFormat] = None
    guided_regex: Optional[GuidedRegex] = None
    guided_grammar: Optional[GuidedGrammar] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Optional[Union[str, list[str]]]) -> Optional[Union[str, list[str]]]:
        strings = [value] if isinstance(value, str) else (value or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(s == "" for s in strings):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _check_input_and_limits(self, info: ValidationInfo) -> "GenerationRequest":
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, messages, prompt_token_ids is required"
                + (f" (got {', '.join(given)})" if given else "")
            )
        limits = (info.context or {}).get("limits") if info.context else None
        if isinstance(limits, RequestLimits):
            check_limits(self, limits)
        return self

    @model_validator(mode="after")
    def _check_one_constraint(self) -> "GenerationRequest":
        given = constraint_fields_given(self.response_format, self.guided_regex, self.guided_grammar)
        if len(given) > 1:
            raise ValueError(f"{given[0]}: at most one constraint per request, got {', '.join(given)}")
        return self

    @property
    def constraint(self) -> Optional[Constraint]:
        return constraint_of(self.response_format, self.guided_regex, self.guided_grammar)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @classmethod
    def validate_payload(cls, payload: Any, limits: RequestLimits | None = None) -> "GenerationRequest":
        """Validate a decoded JSON payload, raising InvalidRequestError that names the field. Its size,
        nesting and text are checked first, cheaply (schemas/payload.py), whether or not `limits` are
        given: without them, RequestLimits' defaults bound the shape."""
        if isinstance(payload, GenerationRequest):
            payload = payload.model_dump(exclude_unset=True)
        if not isinstance(payload, dict):
            raise InvalidRequestError(
                f"request: expected a JSON object, got {type(payload).__name__}", field="request"
            )
        shape = limits or RequestLimits()
        try:
            check_shape(payload, shape.max_messages, shape.max_prompt_chars)
        except ShapeError as exc:
            raise InvalidRequestError(f"invalid request: {exc}", field=exc.field) from None
        try:
            return cls.model_validate(payload, context={"limits": limits} if limits else None)
        except ValidationError as exc:
            raise as_invalid_request(exc) from None

    def to_payload(self) -> dict[str, Any]:
        """The JSON object that goes on the wire: only fields the caller set."""
        return self.model_dump(mode="json", exclude_unset=True)


def check_limits(request: GenerationRequest, limits: RequestLimits) -> None:
    if request.max_tokens is not None and request.max_tokens > limits.max_tokens:
        raise ValueError(f"max_tokens: {request.max_tokens} exceeds this deployment's limit of {limits.max_tokens}")
    if request.max_tokens is not None:  # else the worker checks it, with its default max_tokens
        check_result_entries(request, request.max_tokens, limits)
    if request.prompt_token_ids is not None and len(request.prompt_token_ids) > limits.max_prompt_tokens:
        raise ValueError(
            f"prompt_token_ids: {len(request.prompt_token_ids)} tokens exceeds the limit of "
            f"{limits.max_prompt_tokens}"
        )
    _check_image_limits(request, limits)


def result_entries(n: int, max_tokens: int, top_logprobs: int) -> int:
    """The token entries a result can hold at most: each choice's tokens, and each token's alternatives."""
    return n * max_tokens * (1 + top_logprobs)


def check_result_entries(request: GenerationRequest, max_tokens: int, limits: RequestLimits) -> None:
    """InvalidRequestError unless n x max_tokens x (1 + top_logprobs) is within `limits.max_result_entries`;
    it names top_logprobs, else n, else max_tokens: the first one a caller would lower."""
    entries = result_entries(request.n, max_tokens, request.top_logprobs)
    if entries <= limits.max_result_entries:
        return
    field = "top_logprobs" if request.top_logprobs else "n" if request.n > 1 else "max_tokens"
    raise InvalidRequestError(
        f"{field}: n {request.n} x max_tokens {max_tokens} x (1 + top_logprobs {request.top_logprobs}) = {entries} "
        f"result entries exceeds this deployment's limit of {limits.max_result_entries} (MLXQ_MAX_RESULT_ENTRIES); "
        "lower n, max_tokens or top_logprobs", field=field)


def _check_image_limits(request: GenerationRequest, limits: RequestLimits) -> None:
    """The cheap image checks, before any decoding: how many, and how large an inline one can be."""
    images = [(f"messages[{i}].content[{j}].image_url", part.image_url.url)
              for i, message in enumerate(request.messages or []) if isinstance(message.content, list)
              for j, part in enumerate(message.content) if isinstance(part, ImagePart)]
    if len(images) > limits.max_images:
        raise ValueError(f"messages: {len(images)} images exceed the limit of {limits.max_images} per request "
                         "(MLXQ_MAX_IMAGES)")
    for field, url in images:
        # Base64 carries 3 bytes in 4 characters: a longer inline image cannot fit the byte limit.
        data = url.partition(",")[2] if url.startswith("data:") else url
        if len(data) // 4 * 3 > limits.max_image_bytes + 2:
            raise ValueError(f"{field}: an inline image of about {len(data) // 4 * 3} bytes exceeds the limit "
                             f"of {limits.max_image_bytes} bytes (MLXQ_MAX_IMAGE_BYTES)")


# Pydantic puts the tried union member's type into error locations; users name fields, not types.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|tagged-union\[.*\]|function-.*)$")


def field_named_in(message: str) -> Optional[str]:
    """The field a model-level check names at the start of its message (`guided_regex: at most one
    constraint ...`), pydantic's "Value error, " prefix or not; None if it names none."""
    named = re.match(r"([\w.\[\]]+): ", message.removeprefix("Value error, "))
    return named.group(1) if named else None


def as_invalid_request(exc: ValidationError) -> InvalidRequestError:
    """A pydantic ValidationError as an InvalidRequestError that names the first bad field."""
    errors = exc.errors(include_url=False)
    parts = []
    first_field = None
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err["loc"] if not _UNION_MEMBER.match(str(p)))
        message = err["msg"].removeprefix("Value error, ")
        if not loc:
            first_field = first_field or field_named_in(message) or "prompt"
        first_field = first_field or loc
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        parts.append(f"{loc}: {message}" if loc else message)
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return InvalidRequestError("invalid request: " + "; ".join(parts) + more, field=first_field)
