"""A result as the gateway's responses read it: validated like `parse_result`, but its top logprobs, nearly
all of a large result, kept as validated plain data and made into `TopLogprob` objects a few rows at a time.

A GenerationResult holds one pydantic object per alternative token; at the largest request size a
deployment may allow that is millions of objects, about thirteen times the result's JSON in memory and
seconds of CPU to build (docs/gateway.md, "Large results"). Validated as plain data they take a quarter of
that memory and a tenth of the time, and a response in pieces (`response_pieces`) makes the objects of a
few hundred tokens at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Optional, overload

from pydantic import TypeAdapter
from typing_extensions import TypedDict

from producer.errors import MlxqError
from producer.wire import parse_result
from schemas import GenerationResult, TopLogprob

__all__ = ["LEAN_ABOVE_BYTES", "TopLogprobRows", "parse_result_lean"]

LEAN_ABOVE_BYTES = 256 * 1024  # smaller results are parsed as `parse_result` parses them

# TopLogprob's fields as a TypedDict: the same checks, plain dicts out.
_TopLogprobData = TypedDict(  # type: ignore[misc]
    "_TopLogprobData", {name: Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
                        for name, field in TopLogprob.model_fields.items()})
_TopLogprobData.__pydantic_config__ = {"extra": "forbid"}  # type: ignore[attr-defined]
_ROWS = TypeAdapter(Optional[list[list[_TopLogprobData]]])  # type: ignore[valid-type]


class TopLogprobRows(Sequence[list[TopLogprob]]):
    """A choice's `top_logprobs`, validated, each row made into objects when it is read."""

    def __init__(self, rows: list[list[dict[str, Any]]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> list[TopLogprob]: ...

    @overload
    def __getitem__(self, index: slice) -> list[list[TopLogprob]]: ...

    def __getitem__(self, index: int | slice) -> list[TopLogprob] | list[list[TopLogprob]]:
        if isinstance(index, slice):
            return [self._made(row) for row in self._rows[index]]
        return self._made(self._rows[index])

    def __iter__(self) -> Iterator[list[TopLogprob]]:
        return (self._made(row) for row in self._rows)

    def entries(self) -> int:
        return sum(len(row) for row in self._rows)

    @staticmethod
    def _made(row: list[dict[str, Any]]) -> list[TopLogprob]:
        return [TopLogprob.model_construct(**entry) for entry in row]


def parse_result_lean(job_id: str, raw: bytes, lean_above: int = LEAN_ABOVE_BYTES) -> GenerationResult:
    """`parse_result(job_id, raw)`, the same checks; above `lean_above` bytes each choice's `top_logprobs`
    is a TopLogprobRows. Such a result is for reading: dumping it is not supported."""
    if len(raw) <= lean_above:
        return parse_result(job_id, raw)
    try:
        data = json.loads(raw)
        choices = data.get("choices") if isinstance(data, dict) else None
        rows = [_ROWS.validate_python(choice.pop("top_logprobs", None)) if isinstance(choice, dict) else None
                for choice in (choices if isinstance(choices, list) else [])]
        result = GenerationResult.model_validate(data)
    except ValueError as exc:  # not JSON, or a ValidationError
        raise MlxqError(f"malformed result for job {job_id}: {exc}") from exc
    return result.model_copy(update={"choices": [
        choice if tops is None else choice.model_copy(update={"top_logprobs": TopLogprobRows(tops)})
        for choice, tops in zip(result.choices, rows)]})
