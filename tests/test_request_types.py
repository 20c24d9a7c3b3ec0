"""Strict JSON types in every body a caller sends: where a boolean, an integer or a number is expected,
a string (`"yes"`, `"5"`) is refused naming the field, as OpenAI refuses it; a boolean is not a number
and a fractional number not an integer. Every such field of every model is tried (pure logic)."""

from __future__ import annotations

import types
import typing
from typing import Any, Union

import pytest
from pydantic import BaseModel, ValidationError

from producer.api.batches import BatchCreate, OutputExpiresAfter
from producer.api.routes_control import AbortBody, AdapterBody, PauseBody, WeightsBody
from producer.errors import InvalidRequest
from producer.openai_requests import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    parse_openai_request,
)
from schemas import GenerationRequest, InvalidRequestError

SCALARS = (bool, int, float)


def _scalar(annotation: Any) -> type | None:
    """bool, int or float for a field of that type (or an Optional of it), else None."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    return annotation if annotation in SCALARS else None


def _wrong_values(kind: type) -> list[Any]:
    wrong: list[Any] = ["yes", "1", "true"]
    if kind is not bool:
        wrong.append(True)
    if kind is bool:
        wrong.append(1)
    if kind is int:
        wrong.append(1.5)
    return wrong


def _check(model: type[BaseModel], base: dict[str, Any], validate: Any) -> list[str]:
    """Try each wrong value in each scalar field of `model`; the fields it was tried on."""
    tried = []
    for name, field in model.model_fields.items():
        kind = _scalar(field.annotation)
        if kind is None:
            continue
        tried.append(name)
        for value in _wrong_values(kind):
            with pytest.raises((InvalidRequest, InvalidRequestError, ValidationError)) as info:
                validate({**base, name: value})
            error = info.value
            named = (error.field if not isinstance(error, ValidationError)
                     else ".".join(str(p) for p in error.errors()[0]["loc"]))
            assert named == name, (model.__name__, name, value, str(error))
    return tried


def test_generation_requests_take_json_scalars_as_they_are() -> None:
    tried = _check(GenerationRequest, {"prompt": "x"}, GenerationRequest.validate_payload)
    assert {"logprobs", "stream", "max_tokens", "temperature", "n", "ignore_eos"} <= set(tried)


@pytest.mark.parametrize("path, model, base", [
    (CHAT_PATH, ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    (COMPLETIONS_PATH, CompletionRequest, {"model": "m", "prompt": "x"}),
])
def test_openai_requests_take_json_scalars_as_they_are(path: str, model: type[BaseModel], base: dict) -> None:
    tried = _check(model, base, lambda body: parse_openai_request(path, body))
    assert {"logprobs", "stream", "max_tokens", "temperature", "n"} <= set(tried)
    # An integer where a number is expected is a number, as in JSON.
    assert parse_openai_request(path, {**base, "temperature": 1, "top_p": 1}).temperature == 1.0


@pytest.mark.parametrize("model, base", [
    (StreamOptions, {}),
    (BatchCreate, {"input_file_id": "file-1", "endpoint": "/v1/chat/completions"}),
    (OutputExpiresAfter, {"anchor": "created_at", "seconds": 3600}),
    (WeightsBody, {"version": 1, "path": "/w"}),
    (AdapterBody, {"name": "a", "path": "/a"}),
    (PauseBody, {}),
    (AbortBody, {}),
])
def test_other_bodies_take_json_scalars_as_they_are(model: type[BaseModel], base: dict) -> None:
    assert _check(model, base, model.model_validate) or model is BatchCreate
