"""OpenAI Batch files, without I/O: input lines parsed into GenerationRequests, results turned into output
and error lines. `mlxq batch` (producer/batchrun.py) and the gateway's batches both use it.

An input line: `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`. An output line: `{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body": <the endpoint's response>}, "error": null}`. An error line has the failed request's status code
and OpenAI error body in `response`, or `response: null` and an `error` `{code, message}` for a request
that never ran (invalid, cancelled, expired) or whose result could not be read or converted
(`result_unreadable`: one such line never stops the others from being written).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from producer.errors import InvalidRequest
from producer.openai_requests import CHAT_PATH, COMPLETIONS_PATH, OpenAIRequest, parse_openai_request, to_generation_request
from producer.openai_responses import build_response, dump, encode, response_pieces, result_error
from schemas import GenerationRequest, GenerationResult, RequestLimits

__all__ = [
    "ENDPOINTS",
    "MAX_FILE_BYTES",
    "MAX_LINES",
    "BatchLine",
    "LineError",
    "error_line",
    "line_text",
    "outcome_line",
    "outcome_line_json",
    "parse_line",
    "unreadable_line",
]

ENDPOINTS = (CHAT_PATH, COMPLETIONS_PATH)
# OpenAI's limits for one batch input file.
MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_LINES = 50_000


@dataclass(frozen=True)
class BatchLine:
    """One valid input line. `number` is its 1-based line number in the file."""

    number: int
    custom_id: str
    url: str
    body: OpenAIRequest
    request: GenerationRequest


@dataclass(frozen=True)
class LineError:
    """Why one input line cannot run; `code` and `param` in OpenAI's terms."""

    number: int
    custom_id: Optional[str]
    message: str
    param: Optional[str] = None
    code: str = "invalid_request"

    def as_batch_error(self) -> dict[str, Any]:
        """The entry of a Batch's `errors.data`."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.number}


def parse_line(text: Union[str, bytes], number: int, limits: RequestLimits | None = None,
               endpoint: str | None = None) -> Union[BatchLine, LineError]:
    """Parse and validate one input line (its custom_id is echoed into the request)."""
    try:
        item = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return LineError(number, None, f"line {number}: not valid JSON: {exc}")
    if not isinstance(item, dict):
        return LineError(number, None, f"line {number}: expected a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return LineError(number, None, f"line {number}: custom_id: a string of 1-512 characters is required",
                         "custom_id")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        return LineError(number, custom_id, f"line {number}: {unknown[0]}: unknown field", unknown[0])
    if item.get("method", "POST") != "POST":
        return LineError(number, custom_id, f"line {number}: method: only POST is supported", "method")
    url = item.get("url")
    if url not in ENDPOINTS:
        return LineError(number, custom_id, f"line {number}: url: must be one of {list(ENDPOINTS)}, got {url!r}", "url")
    if endpoint is not None and url != endpoint:
        return LineError(number, custom_id, f"line {number}: url: {url} differs from the batch's endpoint {endpoint}",
                         "url")
    try:
        body = parse_openai_request(url, item.get("body"))
        if body.stream:
            raise InvalidRequest("stream: not supported in a batch", "stream")
        request = to_generation_request(body, limits, custom_id=custom_id)
    except InvalidRequest as exc:
        field = f"body.{exc.field}" if exc.field else "body"
        return LineError(number, custom_id, f"line {number}: {exc}", field)
    return BatchLine(number, custom_id, url, body, request)


def outcome_line(line: BatchLine, job_id: str, result: GenerationResult, created: int) -> tuple[bool, dict[str, Any]]:
    """(is_error, the line) for a request whose job ended: finished goes to the output file, failed
    (with its status code and error body) and cancelled to the error file."""
    if result.status == "finished":
        body = dump(build_response(line.body, job_id, result, created))
        return False, _line(job_id, line.custom_id, {"status_code": 200, "request_id": job_id, "body": body}, None)
    failed = result_error(result)
    if failed is not None:
        status, error = failed
        return True, _line(job_id, line.custom_id, {"status_code": status, "request_id": job_id, "body": error}, None)
    return True, error_line(line.custom_id, "batch_cancelled", "the request was cancelled before it ended", job_id)


def outcome_line_json(line: BatchLine, job_id: str, result: GenerationResult, created: int) -> tuple[bool, bytes]:
    """`outcome_line` as one line of JSON, its response body made in pieces (`response_pieces`): a large
    result's line is never held as Python objects."""
    if result.status != "finished":
        is_error, out = outcome_line(line, job_id, result, created)
        return is_error, encode(out)
    marker = f"\x00{uuid.uuid4().hex}\x00"  # where the body goes
    frame = encode(_line(job_id, line.custom_id, {"status_code": 200, "request_id": job_id, "body": marker}, None))
    before, _, after = frame.partition(encode(marker))
    return False, b"".join([before, *response_pieces(line.body, job_id, result, created), after])


def error_line(custom_id: Optional[str], code: str, message: str, job_id: str | None = None) -> dict[str, Any]:
    """The error-file line of a request that never produced a response."""
    return _line(job_id or "", custom_id, None, {"code": code, "message": message})


def unreadable_line(custom_id: Optional[str], job_id: str, exc: BaseException) -> dict[str, Any]:
    """The error-file line of a request whose job ended with a result that could not be read or
    turned into a line."""
    return error_line(custom_id, "result_unreadable", "the request ended but its result could not be read or "
                      f"converted: {type(exc).__name__}: {str(exc)[:300]}", job_id)


def line_text(line: dict[str, Any]) -> str:
    """A line as JSON proper: ValueError for a NaN or Infinity, which JSON has not (results hold none:
    schemas.result)."""
    return json.dumps(line, ensure_ascii=False, allow_nan=False)


def _line(job_id: str, custom_id: Optional[str], response: Optional[dict[str, Any]],
          error: Optional[dict[str, Any]]) -> dict[str, Any]:
    return {"id": f"batch_req_{job_id}" if job_id else "batch_req", "custom_id": custom_id,
            "response": response, "error": error}
