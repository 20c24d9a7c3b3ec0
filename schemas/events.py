"""The events of a job's token stream (`mlxq:stream:<job_id>`), as both sides read and write them.

Each stream entry has one field, `data`, holding one event as JSON: a `token` event per choice per
decode step that produced something, then one `end` event. A choice's texts add up to its final
`text` and its token ids to its `token_ids`, counted from the last `restart` event: a job that goes
back to its queue to run again (a weight swap under `abort`, a pause with `abort`, a failed engine
step) restarts its stream, and what came before that event is void.

A token event of a request that asked for `logprobs` also carries `logprobs` (one per token id) and,
with `top_logprobs`, `top_logprobs` (one list per token id), as the result's choice has them. The two
fields are left out of the entry otherwise, so a stream without logprobs is what it always was. A
logprob that is not finite (-inf: a token outside the processed distribution's support) is null, as
in the result (`schemas.result.Logprob`).

A reply parsed for reasoning or tool calls (docs/tools.md) splits its text: `text` carries the answer,
`reasoning_content` the reasoning, `tool_calls` each call once it is complete (with its id, name and
whole arguments); the two fields are left out where empty. Their token ids stay in `token_ids`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.agents import ToolCall
from schemas.result import FinishReason, Logprob, Status, TopLogprob

STREAM_FIELD = "data"


class TokenStreamEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event: Literal["token"] = "token"
    index: int
    token_ids: list[int]
    text: str
    logprobs: Optional[list[Logprob]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class EndStreamEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event: Literal["end"] = "end"
    status: Status
    finish_reasons: list[Optional[FinishReason]]


class RestartStreamEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event: Literal["restart"] = "restart"
    reason: str  # why the job runs again from the start


StreamEvent = Annotated[Union[TokenStreamEvent, EndStreamEvent, RestartStreamEvent], Field(discriminator="event")]
_EVENT = TypeAdapter(StreamEvent)


AnyStreamEvent = Union[TokenStreamEvent, EndStreamEvent, RestartStreamEvent]


_OPTIONAL_TOKEN_FIELDS = ("logprobs", "top_logprobs", "reasoning_content", "tool_calls")


def encode_event(event: AnyStreamEvent) -> dict[str, str]:
    """The fields of the stream entry that carries `event`."""
    if isinstance(event, TokenStreamEvent):
        return {STREAM_FIELD: event.model_dump_json(exclude={f for f in _OPTIONAL_TOKEN_FIELDS
                                                             if getattr(event, f) is None})}
    return {STREAM_FIELD: event.model_dump_json()}


def event_data(event: AnyStreamEvent) -> dict[str, Any]:
    """The event as a reader yields it: a token event's logprob fields only where it has them."""
    data = event.model_dump()
    if isinstance(event, TokenStreamEvent):
        for name in _OPTIONAL_TOKEN_FIELDS:
            if data[name] is None:
                del data[name]
    return data


def parse_event(fields: dict[bytes, bytes]) -> AnyStreamEvent:
    """The event a stream entry (as redis-py returns its fields) carries."""
    return _EVENT.validate_json(fields[STREAM_FIELD.encode()])
