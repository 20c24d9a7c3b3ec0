"""GenerationResult: what the worker writes to `mlxq:result:<job_id>`."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict

from schemas.agents import ToolCall

Status = Literal["finished", "failed", "cancelled"]
# "tool_calls": the reply ended (EOS or a stop token) having made tool calls (schemas/agents.py).
FinishReason = Literal["stop", "length", "cancelled", "timeout", "error", "tool_calls"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def finite_or_none(value: Optional[float]) -> Optional[float]:
    """JSON has no infinities or NaN, so a number that is not finite is held (and written) as None."""
    return value if value is None or math.isfinite(value) else None


# A log-probability as results and stream events hold it: a finite float, or None (JSON null) for one
# that is not finite: -inf, a token outside the reported distribution's support (probability 0, as
# `logprobs_mode: "processed"` gives every token that top-k, top-p, min-p or a constraint's mask
# ruled out), or NaN (a model whose outputs are not finite). docs/interface.md says so too.
Logprob = Annotated[Optional[float], AfterValidator(finite_or_none)]
# A time or duration: finite, or None.
Seconds = Annotated[Optional[float], AfterValidator(finite_or_none)]


class TopLogprob(_Model):
    token_id: int
    token: str
    logprob: Logprob


class Choice(_Model):
    index: int
    text: str
    token_ids: list[int]
    # logprobs[i] is log p(token_ids[i]) under the distribution `logprobs_mode` names (see README);
    # None where that is not finite (see `Logprob`).
    logprobs: Optional[list[Logprob]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    finish_reason: Optional[FinishReason] = None
    # Requests with a constraint (response_format, guided_regex, guided_grammar): whether `text` is a
    # complete match; false when it ended first (`length`, a stop string, cancelled). Null otherwise.
    constraint_complete: Optional[bool] = None
    # The version of the weights that produced this choice (the one its first token came from), and,
    # where weights were swapped while it decoded, each version from the token index it began at:
    # [[first_token_index, version], ...]. Null for a worker whose weights carry no version.
    weight_version: Optional[int] = None
    weight_versions: Optional[list[tuple[int, int]]] = None
    # Agents (docs/tools.md). A reply parsed for tool calls or reasoning has `text` = its answer only:
    # the calls' markup is in `tool_calls` (parsed), the reasoning in `reasoning_content`; token_ids
    # keep every token. `tool_call_error`: why text that began a tool call did not parse as one (it
    # is then left in `text`); null otherwise.
    tool_calls: Optional[list[ToolCall]] = None
    reasoning_content: Optional[str] = None
    tool_call_error: Optional[str] = None
    # The stop string that ended the choice (finish_reason "stop" by a stop string); null otherwise.
    stop_sequence: Optional[str] = None


class PromptLogprobs(_Model):
    """The prompt's tokens under the model's raw distribution: `logprobs[i]` is log p(token_ids[i] |
    token_ids[:i]), null for the first token (nothing precedes it); `top_logprobs[i]` the most likely
    tokens at position i (an empty list at 0), when asked for (`prompt_logprobs` > 0)."""

    token_ids: list[int]
    tokens: list[str]  # each token's text
    logprobs: list[Optional[float]]
    top_logprobs: Optional[list[list[TopLogprob]]] = None


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Timings(_Model):
    """Wall-clock instants are Unix seconds; durations are seconds."""

    enqueued_at: Seconds = None
    started_at: Seconds = None
    finished_at: Seconds = None
    queue_s: Seconds = None
    ttft_s: Seconds = None
    generation_s: Seconds = None


class ErrorInfo(_Model):
    type: str
    message: str


def request_echo(payload: Any) -> dict[str, Any]:
    """The request fields a result repeats (custom_id, model, metadata), read from a raw payload
    that may not be valid; best effort."""
    if not isinstance(payload, Mapping):
        return {}
    echo: dict[str, Any] = {}
    for name in ("custom_id", "model"):
        if isinstance(payload.get(name), str):
            echo[name] = payload[name]
    metadata = payload.get("metadata")
    if isinstance(metadata, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        echo["metadata"] = dict(metadata)
    return echo


class Speculation(_Model):
    """How a job speculated (docs/speculative.md): its drafter, the tokens it proposed over every
    choice, and how many of them were accepted (each accepted token is one the model would have
    made anyway; the output is the same as without speculation)."""

    drafter: Literal["ngram", "draft"]
    proposed: int
    accepted: int


class GenerationResult(_Model):
    id: str
    custom_id: Optional[str] = None
    model: Optional[str] = None
    status: Status
    choices: list[Choice] = []
    prompt_token_ids: Optional[list[int]] = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    worker: Optional[str] = None
    error: Optional[ErrorInfo] = None
    metadata: Optional[dict[str, str]] = None
    weight_version: Optional[int] = None  # the weights that produced it (the oldest, if choices differ)
    adapter: Optional[str] = None  # the LoRA adapter that produced it (None: the base model)
    prompt_logprobs: Optional[PromptLogprobs] = None  # when the request asked for prompt_logprobs
    speculation: Optional[Speculation] = None  # when the job speculated (docs/speculative.md)


def timings(enqueued_at: Optional[float], started_at: Optional[float], finished_at: float,
            first_token_at: Optional[float] = None) -> Timings:
    """A job's instants (Unix seconds) and the durations they give."""
    return Timings(
        enqueued_at=enqueued_at,
        started_at=started_at,
        finished_at=finished_at,
        queue_s=(started_at - enqueued_at) if enqueued_at and started_at else None,
        ttft_s=(first_token_at - started_at) if first_token_at and started_at else None,
        generation_s=(finished_at - started_at) if started_at else None,
    )


def no_output_result(job_id: str, status: Status, *, error_type: Optional[str] = None, message: str = "",
                     request: Any = None, model: Optional[str] = None, worker: Optional[str] = None,
                     enqueued_at: Seconds = None, started_at: Optional[float] = None) -> GenerationResult:
    """The result of a job that ended without output: refused, failed before it ran, cancelled
    while queued, abandoned by a dead worker. The one place such results are built, by workers and
    producers alike; it echoes what it can of the raw `request` (custom_id, model, metadata)."""
    echo = request_echo(request)
    return GenerationResult(
        id=job_id, custom_id=echo.get("custom_id"), model=echo.get("model", model), status=status,
        worker=worker, metadata=echo.get("metadata"),
        timings=timings(enqueued_at, started_at, time.time()),
        error=ErrorInfo(type=error_type, message=message) if error_type and status != "cancelled" else None,
    )
