"""The events of a job's token stream (`mlxq:stream:<job_id>`), as both sides read and write them.

Each stream entry has one field, `data`, holding one event as JSON: a `token` event per choice per
decode step that produced something, then one `end` event. A choice's texts add up to its final
`text` and its token ids to its `token_ids`, counted from the last `restart` event: a job that goes
back to its queue to run again (a weight swap under `abort`, a pause with `abort`, a failed engine
step) restarts its stream, and what came before that event is void.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.result import FinishReason, Status

STREAM_FIELD = "data"


class TokenStreamEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event: Literal["token"] = "token"
    index: int
    token_ids: list[int]
    text: str


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


def encode_event(event: AnyStreamEvent) -> dict[str, str]:
    """The fields of the stream entry that carries `event`."""
    return {STREAM_FIELD: event.model_dump_json()}


def parse_event(fields: dict[bytes, bytes]) -> AnyStreamEvent:
    """The event a stream entry (as redis-py returns its fields) carries."""
    return _EVENT.validate_json(fields[STREAM_FIELD.encode()])
