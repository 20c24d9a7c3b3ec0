"""OpenAI's response shapes built from mlxq results and stream events, and OpenAI's error shape. No I/O.

Token ids for RL users (asked for with `return_token_ids: true`): a response carries
`prompt_token_ids` at its top level and `token_ids` in each choice (vLLM's names); a stream carries
each chunk's `token_ids` in its choice and `prompt_token_ids` in the last chunk of the response (the
prompt's ids are known once the job ends).

Logprobs: a sampled token's string comes from its own top-logprobs entry when it is there, else it is
`token_id:<id>` (vLLM's spelling); a stream sends each chunk's logprobs with it, or, from a worker whose
token events carry none, a choice's logprobs with its last chunk.
A logprob that is not finite (-inf: a token outside the processed distribution's support) is null, as
in mlxq's results. Finish reasons are mlxq's: OpenAI's `stop`, `length` and `tool_calls`, and `cancelled` or `timeout`.

Agents (docs/tools.md): a chat message carries `tool_calls` (OpenAI's shape) and `reasoning_content`;
its content is null where it only calls. A stream's delta carries `reasoning_content` as the reasoning
grows and, for each call once complete, two `tool_calls` deltas (its index, id, type and name with
empty arguments, then the arguments), as OpenAI's streams do. A choice whose text began a call that
did not parse carries `tool_call_error` (the text stays in the content). A completion with `echo` has
the prompt's text (and with `logprobs` its tokens, their logprobs and top entries, the first token's
null) ahead of the completion's.

A blocking response goes out as `response_pieces`: exactly Starlette's `JSONResponse` rendering of
`dump(build_response(...))`, but its per-token logprobs, nearly all of a large response (each token and
its alternatives with their UTF-8 bytes), made and encoded a few hundred tokens at a time, so the whole
response never exists as Python objects nor needs to exist whole as JSON (docs/gateway.md).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel

from producer.openai_requests import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from schemas import Choice, GenerationResult, TopLogprob
from schemas.agents import ToolCall
from schemas.result import Logprob, PromptLogprobs

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChunkWriter",
    "Completion",
    "ErrorBody",
    "build_response",
    "dump",
    "encode",
    "error_body",
    "merge_completions",
    "response_entries",
    "response_pieces",
    "result_error",
]


class TopLogprobOut(BaseModel):
    token: str
    logprob: Logprob  # null: -inf, a token outside the distribution's support (schemas.result.Logprob)
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprobOut):
    top_logprobs: list[TopLogprobOut] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Logprob]
    top_logprobs: Optional[list[Optional[dict[str, Logprob]]]] = None  # (an echoed prompt's first: null)
    text_offset: list[int]


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    reasoning_content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None
    tool_call_error: Optional[str] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageOut] = None
    system_fingerprint: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageOut] = None
    system_fingerprint: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Optional[UsageOut] = None
    prompt_token_ids: Optional[list[int]] = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def result_error(result: GenerationResult) -> tuple[int, dict[str, Any]] | None:
    """(HTTP status, error body) for a failed job, None for one that finished or was cancelled."""
    if result.status != "failed":
        return None
    error = result.error
    kind, message = (error.type, error.message) if error else ("Error", "the job failed")
    if kind in ("InvalidRequest", "InvalidRequestError"):
        field = message.removeprefix("invalid request: ").split(":", 1)[0]
        return 400, error_body(message, param=field if field.replace(".", "").replace("_", "").isalnum() else None)
    if kind == "JobTimeoutException":
        return 504, error_body(message, "timeout", code="job_timeout")
    return 500, error_body(f"{kind}: {message}", "server_error", code=kind)


def _usage(result: GenerationResult) -> UsageOut:
    usage = result.usage
    return UsageOut(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens)


def _token_string(token_id: int, tops: Sequence[TopLogprob]) -> str:
    for entry in tops:
        if entry.token_id == token_id:
            return entry.token
    return f"token_id:{token_id}"


def _tops(top_logprobs: Optional[Sequence[Sequence[TopLogprob]]], position: int) -> Sequence[TopLogprob]:
    return top_logprobs[position] if top_logprobs and position < len(top_logprobs) else []


def _chat_logprobs_of(token_ids: Sequence[int], logprobs: Sequence[Optional[float]],
                      top_logprobs: Optional[Sequence[Sequence[TopLogprob]]]) -> ChoiceLogprobs:
    """Chat's logprobs object for these tokens (a whole choice, or one chunk's)."""
    content = []
    for i, logprob in enumerate(logprobs):
        tops = _tops(top_logprobs, i)
        token = _token_string(token_ids[i], tops)
        content.append(TokenLogprob(
            token=token, logprob=logprob, bytes=list(token.encode()),
            top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token.encode())) for t in tops]))
    return ChoiceLogprobs(content=content)


def _completion_logprobs_of(token_ids: Sequence[int], logprobs: Sequence[Optional[float]],
                            top_logprobs: Optional[Sequence[Sequence[TopLogprob]]], offset: int = 0
                            ) -> CompletionLogprobs:
    """Completions' logprobs lists for these tokens, their text offsets counted from `offset`."""
    tokens = [_token_string(token_ids[i], _tops(top_logprobs, i)) for i in range(len(logprobs))]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops = None
    if top_logprobs is not None:
        tops = [{t.token: t.logprob for t in entry} for entry in top_logprobs]
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=tops, text_offset=offsets)


def _chat_logprobs(choice: Choice) -> ChoiceLogprobs | None:
    if choice.logprobs is None:
        return None
    return _chat_logprobs_of(choice.token_ids, choice.logprobs, choice.top_logprobs)


def _completion_logprobs(choice: Choice) -> CompletionLogprobs | None:
    if choice.logprobs is None:
        return None
    return _completion_logprobs_of(choice.token_ids, choice.logprobs, choice.top_logprobs)


def build_response(body: OpenAIRequest, job_id: str, result: GenerationResult, created: int
                   ) -> Union[ChatCompletion, Completion]:
    """The blocking response to `body` from the job's result."""
    ids = body.return_token_ids
    extra = {"prompt_token_ids": result.prompt_token_ids} if ids else {}
    if isinstance(body, ChatCompletionRequest):
        return ChatCompletion(
            id=f"chatcmpl-{job_id}", created=created, model=body.model, usage=_usage(result), **extra,
            choices=[ChatChoice(index=c.index, message=_message(c), logprobs=_chat_logprobs(c),
                                finish_reason=c.finish_reason, tool_call_error=c.tool_call_error,
                                **({"token_ids": c.token_ids} if ids else {}))
                     for c in result.choices])
    return Completion(
        id=f"cmpl-{job_id}", created=created, model=body.model, usage=_usage(result), **extra,
        choices=[CompletionChoice(index=c.index, text=_echoed(body, result.prompt_logprobs) + c.text,
                                  logprobs=_completion_logprobs_echoed(body, c, result.prompt_logprobs),
                                  finish_reason=c.finish_reason, **({"token_ids": c.token_ids} if ids else {}))
                 for c in result.choices])


def merge_completions(responses: Sequence[Completion], n: int) -> Completion:
    """The responses to the prompts of one completion request, as one: prompt i's choice j at index i * n + j."""
    first = responses[0]
    choices = [choice.model_copy(update={"index": i * n + choice.index})
               for i, response in enumerate(responses) for choice in response.choices]
    usage = None
    if all(r.usage is not None for r in responses):
        usage = UsageOut(prompt_tokens=sum(r.usage.prompt_tokens for r in responses),  # type: ignore[union-attr]
                         completion_tokens=sum(r.usage.completion_tokens for r in responses),  # type: ignore[union-attr]
                         total_tokens=sum(r.usage.total_tokens for r in responses))  # type: ignore[union-attr]
    return first.model_copy(update={"choices": choices, "usage": usage})


def _message(choice: Choice) -> AssistantMessage:
    """A choice as an assistant message: content null where it only calls tools."""
    content: Optional[str] = choice.text
    if choice.tool_calls and not content:
        content = None
    return AssistantMessage(content=content, tool_calls=choice.tool_calls or None,
                            reasoning_content=choice.reasoning_content)


def _echoed(body: OpenAIRequest, prompt: Optional[PromptLogprobs]) -> str:
    """The prompt's text, for a completion with echo."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return ""
    if isinstance(body.prompt, str):
        return body.prompt
    return "".join(prompt.tokens) if prompt is not None else ""


def _completion_logprobs_echoed(body: OpenAIRequest, choice: Choice, prompt: Optional[PromptLogprobs]
                                ) -> Optional[CompletionLogprobs]:
    """Completions' logprobs; with echo, the prompt's tokens ahead of the choice's."""
    made = _completion_logprobs(choice)
    if not isinstance(body, CompletionRequest) or not body.echo or body.logprobs is None or prompt is None:
        return made
    tops: Optional[list[Optional[dict[str, float]]]] = None
    if prompt.top_logprobs is not None:
        tops = [({t.token: t.logprob for t in row} if i else None) for i, row in enumerate(prompt.top_logprobs)]
    tokens = list(prompt.tokens)
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    echoed = CompletionLogprobs(tokens=tokens, token_logprobs=list(prompt.logprobs), top_logprobs=tops,  # type: ignore[arg-type]
                                text_offset=offsets)
    if made is None:
        return echoed
    shift = len(_echoed(body, prompt))
    return CompletionLogprobs(
        tokens=echoed.tokens + made.tokens, token_logprobs=echoed.token_logprobs + made.token_logprobs,
        top_logprobs=(None if tops is None and made.top_logprobs is None else
                      (tops or [None] * len(tokens)) + list(made.top_logprobs or [{}] * len(made.tokens))),
        text_offset=offsets + [shift + o for o in made.text_offset])


_EXTENSIONS = ("token_ids", "prompt_token_ids", "tool_call_error")
_MESSAGE_EXTENSIONS = ("tool_calls", "reasoning_content")


def dump(model: BaseModel) -> dict[str, Any]:
    """A response as JSON-ready data, with the fields OpenAI's responses do not have (token ids,
    tool calls, reasoning) only where they have something."""
    data = model.model_dump(mode="json")
    for item in (data, *data.get("choices", ())):
        for name in _EXTENSIONS:
            if item.get(name, 0) is None:
                del item[name]
        message = item.get("message") or item.get("delta")
        for name in _MESSAGE_EXTENSIONS:
            if isinstance(message, dict) and message.get(name, 0) is None:
                del message[name]
    return data


# -- blocking responses as JSON bytes, in pieces

PIECE_TOKENS = 256  # tokens whose logprobs are made and encoded together

# Starlette's JSONResponse.render settings: the same bytes whichever way a response goes out.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def encode(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def response_entries(result: GenerationResult) -> int:
    """About the logprob entries a response to `result` carries: each token's, and each alternative's
    (as many for every token as for the first)."""
    return sum(len(c.logprobs or ()) * (1 + (len(c.top_logprobs[0]) if c.top_logprobs else 0))
               for c in result.choices)


def response_pieces(body: OpenAIRequest, job_id: str, result: GenerationResult, created: int,
                    piece_tokens: int = PIECE_TOKENS) -> Iterator[bytes]:
    """`encode(dump(build_response(body, job_id, result, created)))`, in pieces."""
    if getattr(body, "echo", False):  # the prompt's logprobs lead each choice's: made whole (a prompt is bounded)
        yield encode(dump(build_response(body, job_id, result, created)))
        return
    bare = result.model_copy(update={"choices": [c.model_copy(update={"logprobs": None, "top_logprobs": None})
                                                 for c in result.choices]})
    shell = dump(build_response(body, job_id, bare, created))
    # Each choice with logprobs gets an unguessable marker in the shell, where its logprobs go.
    nonce = uuid.uuid4().hex
    markers: list[tuple[bytes, Choice]] = []
    for data, choice in zip(shell["choices"], result.choices):
        if choice.logprobs is not None:
            marker = f"\x00{nonce}:{choice.index}\x00"
            data["logprobs"] = marker
            markers.append((encode(marker), choice))
    rest = encode(shell)
    chat = isinstance(body, ChatCompletionRequest)
    for marker, choice in markers:
        before, _, rest = rest.partition(marker)
        yield before
        yield from (_chat_logprobs_json(choice, piece_tokens) if chat else _completion_logprobs_json(choice, piece_tokens))
    yield rest


def _chat_logprobs_json(choice: Choice, piece_tokens: int) -> Iterator[bytes]:
    """`{"content":[...],"refusal":null}`, as `ChoiceLogprobs` dumps it."""
    logprobs = choice.logprobs or []
    yield b'{"content":['
    for start in range(0, len(logprobs), piece_tokens):
        end = start + piece_tokens
        part = _chat_logprobs_of(choice.token_ids[start:end], logprobs[start:end],
                                 choice.top_logprobs[start:end] if choice.top_logprobs is not None else None)
        items = encode(part.model_dump(mode="json")["content"])[1:-1]
        yield (b"," + items) if start else items
    yield b'],"refusal":null}'


def _completion_logprobs_json(choice: Choice, piece_tokens: int) -> Iterator[bytes]:
    """`{"tokens":...,"token_logprobs":...,"top_logprobs":...,"text_offset":...}`, as `CompletionLogprobs`
    dumps it."""
    logprobs = choice.logprobs or []
    tops = choice.top_logprobs
    tokens = [_token_string(choice.token_ids[i], _tops(tops, i)) for i in range(len(logprobs))]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    yield b'{"tokens":' + encode(tokens) + b',"token_logprobs":' + encode(list(logprobs)) + b',"top_logprobs":'
    if tops is None:
        yield b"null"
    else:
        yield from _top_dicts(tops, piece_tokens)
    yield b',"text_offset":' + encode(offsets) + b"}"


def _top_dicts(tops: Sequence[Sequence[TopLogprob]], piece_tokens: int) -> Iterator[bytes]:
    yield b"["
    for start in range(0, len(tops), piece_tokens):
        items: list[Optional[dict[str, float]]] = [{t.token: t.logprob for t in entry}
                                                   for entry in tops[start:start + piece_tokens]]
        encoded = encode(items)[1:-1]
        yield (b"," + encoded) if start else encoded
    yield b"]"


def merge_token_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Token events that arrived together as one per choice (its tokens, texts and logprobs joined),
    so that a client the gateway fell behind on gets fewer, larger chunks; other events keep their
    place, and no token moves past one."""
    merged: list[dict[str, Any]] = []
    joining: dict[int, dict[str, Any]] = {}  # each choice's event since the last event of another kind
    for event in events:
        if event["event"] != "token":
            joining = {}
            merged.append(event)
            continue
        into = joining.get(event["index"])
        if into is None or any((into.get(f) is None) != (event.get(f) is None) for f in ("logprobs", "top_logprobs")):
            joining[event["index"]] = into = dict(event)
            merged.append(into)
            continue
        into["token_ids"] = into["token_ids"] + event["token_ids"]
        into["text"] = into["text"] + event["text"]
        if event.get("reasoning_content"):
            into["reasoning_content"] = (into.get("reasoning_content") or "") + event["reasoning_content"]
        if event.get("tool_calls"):
            into["tool_calls"] = (into.get("tool_calls") or []) + event["tool_calls"]
        for field in ("logprobs", "top_logprobs"):
            if into.get(field) is not None:
                into[field] = into[field] + event[field]
    return merged


class ChunkWriter:
    """One streamed response: OpenAI chunks (as dicts) from a job's stream events, in order."""

    def __init__(self, body: OpenAIRequest, job_id: str, created: int) -> None:
        self.body = body
        self.chat = isinstance(body, ChatCompletionRequest)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{job_id}"
        self.created = created
        self.wants_logprobs = bool(body.logprobs) if self.chat else body.logprobs is not None
        # Choices whose token chunks carried their own logprobs, and (completions) each one's next text_offset.
        self._streamed_logprobs: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._calls: dict[int, int] = {}  # tool calls sent so far, per choice

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.body.model, "choices": choices}
        chunk.update(extra)
        return chunk

    def _choice(self, index: int, text: str | None, finish_reason: str | None = None, *, role: bool = False,
                logprobs: Any = None, token_ids: list[int] | None = None, reasoning: str | None = None
                ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if role else {}
            if text and not role:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None and self.body.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def opening(self) -> list[dict[str, Any]]:
        """What goes out before the first token: the assistant role of each chat choice."""
        if not self.chat:
            return []
        return [self._chunk([self._choice(i, "", role=True) for i in range(self.body.n)])]

    def token(self, event: dict[str, Any]) -> dict[str, Any]:
        """The chunk of one token event's text (and reasoning)."""
        index = event["index"]
        return self._chunk([self._choice(index, event["text"], token_ids=event["token_ids"],
                                         logprobs=self._chunk_logprobs(index, event),
                                         reasoning=event.get("reasoning_content"))])

    def token_chunks(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks of one token event: its text's (`token`), then two for each tool call it completed."""
        index = event["index"]
        chunks = [self.token(event)]
        for call in event.get("tool_calls") or () if self.chat else ():
            position = self._calls.get(index, 0)
            self._calls[index] = position + 1
            function = call["function"]
            opened = {"index": position, "id": call["id"], "type": "function",
                      "function": {"name": function["name"], "arguments": ""}}
            for entry in (opened, {"index": position, "function": {"arguments": function["arguments"]}}):
                chunks.append(self._chunk([{"index": index, "delta": {"tool_calls": [entry]}, "logprobs": None,
                                            "finish_reason": None}]))
        return chunks

    def _chunk_logprobs(self, index: int, event: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The logprobs of one token event's tokens, in OpenAI's shape; None without them."""
        logprobs = event.get("logprobs")
        if not self.wants_logprobs or logprobs is None:
            return None
        self._streamed_logprobs.add(index)
        if not logprobs:
            return None
        token_ids = event["token_ids"]
        raw_tops = event.get("top_logprobs")
        tops = None if raw_tops is None else [[TopLogprob.model_validate(t) for t in row] for row in raw_tops]
        if self.chat:
            return dump(_chat_logprobs_of(token_ids, logprobs, tops))
        made = _completion_logprobs_of(token_ids, logprobs, tops, self._offsets.get(index, 0))
        self._offsets[index] = made.text_offset[-1] + len(made.tokens[-1])
        return dump(made)

    def closing(self, result: GenerationResult) -> list[dict[str, Any]]:
        """The last chunks: each choice's finish reason (with its logprobs, when asked), then usage."""
        failed = result_error(result)
        if failed is not None:
            return [failed[1]]
        ids = {"prompt_token_ids": result.prompt_token_ids} if self.body.return_token_ids else {}
        chunks = []
        for c in result.choices:
            logprobs = None
            if c.index not in self._streamed_logprobs:  # a worker whose events carry none: all of them here
                logprobs = _chat_logprobs(c) if self.chat else _completion_logprobs(c)
            chunks.append(self._chunk([self._choice(c.index, None, c.finish_reason, token_ids=[],
                                                    logprobs=dump(logprobs) if logprobs else None)]))
        if not chunks:  # cancelled before it started
            chunks.append(self._chunk([self._choice(i, None, "cancelled") for i in range(self.body.n)]))
        if self.body.include_usage:
            chunks.append(self._chunk([], usage=dump(_usage(result))))
        chunks[-1].update(ids)
        return chunks
