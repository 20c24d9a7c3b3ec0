"""GenerationResult: what the worker writes to `mlxq:result:<job_id>`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

Status = Literal["finished", "failed", "cancelled"]
FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopLogprob(_Model):
    token_id: int
    token: str
    logprob: float


class Choice(_Model):
    index: int
    text: str
    token_ids: list[int]
    # logprobs[i] is log p(token_ids[i]) under the model's raw distribution (see README).
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    finish_reason: Optional[FinishReason] = None
    # Requests with a constraint (response_format, guided_regex, guided_grammar): whether `text` is a
    # complete match; false when it ended first (`length`, a stop string, cancelled). Null otherwise.
    constraint_complete: Optional[bool] = None


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Timings(_Model):
    """Wall-clock instants are Unix seconds; durations are seconds."""

    enqueued_at: Optional[float] = None
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    queue_s: Optional[float] = None
    ttft_s: Optional[float] = None
    generation_s: Optional[float] = None


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
