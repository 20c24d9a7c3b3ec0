"""What one request can make, and how the gateway serves a large result: the cap on n x max_tokens x
(1 + top_logprobs) in the schema, the gateway and a real worker process; responses made in pieces that
are byte for byte what the whole-response path made; `GET /v1/jobs` read from the result key in ranges;
batch output lines made the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from mlxq.redis_server import RedisServer
from producer.api import stored_results
from producer.api.stored_results import open_result
from producer.errors import MlxqError
from producer.lean_results import parse_result_lean
from producer.wire import parse_result
from producer.openai_requests import ChatCompletionRequest, CompletionRequest
from producer.openai_responses import build_response, dump, response_pieces
from schemas import GenerationRequest, GenerationResult, InvalidRequestError, RequestLimits, keys
from schemas.result import Choice, TopLogprob, Usage
from tests.gateway import running_gateway, wait_live
from tests.workers import start_fake_worker, stop

# ---------------------------------------------------------------- the cap


def test_the_cap_names_the_field_to_lower_and_the_limit() -> None:
    limits = RequestLimits()
    with pytest.raises(InvalidRequestError) as refused:
        GenerationRequest.validate_payload({"prompt": "x", "n": 16, "max_tokens": 4096, "logprobs": True,
                                            "top_logprobs": 20}, limits)
    assert refused.value.field == "top_logprobs"
    assert "1376256 result entries" in str(refused.value) and str(limits.max_result_entries) in str(refused.value)
    with pytest.raises(InvalidRequestError) as refused:
        GenerationRequest.validate_payload({"prompt": "x", "n": 16, "max_tokens": 4096}, RequestLimits(
            max_result_entries=60_000))
    assert refused.value.field == "n"
    with pytest.raises(InvalidRequestError) as refused:
        GenerationRequest.validate_payload({"prompt": "x", "max_tokens": 4096}, RequestLimits(max_result_entries=4000))
    assert refused.value.field == "max_tokens"
    # at the limit is fine; without max_tokens the worker checks it with its own default
    GenerationRequest.validate_payload({"prompt": "x", "n": 2, "max_tokens": 4096, "top_logprobs": 15}, limits)
    GenerationRequest.validate_payload({"prompt": "x", "n": 16, "top_logprobs": 20}, limits)


# ---------------------------------------------------------------- responses in pieces

_tokens = st.text(st.characters(codec="utf-8"), max_size=6)  # any text, control characters and NULs too


@st.composite
def results(draw: st.DrawFn) -> GenerationResult:
    choices = []
    for index in range(draw(st.integers(1, 3))):
        length = draw(st.integers(0, 12))
        token_ids = draw(st.lists(st.integers(0, 300), min_size=length, max_size=length))
        logprobs = draw(st.none() | st.lists(st.floats(-50, 0), min_size=length, max_size=length))
        tops = None
        if logprobs is not None and draw(st.booleans()):
            tops = [draw(st.lists(st.builds(TopLogprob, token_id=st.integers(0, 300), token=_tokens,
                                            logprob=st.floats(-50, 0)), max_size=4)) for _ in range(length)]
        choices.append(Choice(index=index, text=draw(_tokens), token_ids=token_ids, logprobs=logprobs,
                              top_logprobs=tops, finish_reason=draw(st.sampled_from(["stop", "length", None]))))
    return GenerationResult(id="j", status="finished", choices=choices, usage=Usage(prompt_tokens=3),
                            prompt_token_ids=draw(st.none() | st.lists(st.integers(0, 9), max_size=3)))


@settings(max_examples=150, deadline=None)
@given(result=results(), chat=st.booleans(), ids=st.booleans(), piece_tokens=st.integers(1, 5))
def test_a_response_in_pieces_is_the_whole_response_byte_for_byte(result: GenerationResult, chat: bool, ids: bool,
                                                                  piece_tokens: int) -> None:
    body = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], return_token_ids=ids)
            if chat else CompletionRequest(model="m", prompt="x", return_token_ids=ids))
    whole = JSONResponse(dump(build_response(body, "j", result, 7))).body
    assert b"".join(response_pieces(body, "j", result, 7, piece_tokens)) == whole


# ---------------------------------------------------------------- result keys read in ranges


@pytest.fixture
def conn(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def _big_result(choices: int = 40, tokens: int = 400) -> GenerationResult:
    tops = [[TopLogprob(token_id=t, token=f"tok{t}é", logprob=-1.5)] * 3 for t in range(tokens)]
    return GenerationResult(id="big", custom_id="c" * 100, model="fake", status="finished", choices=[
        Choice(index=i, text="x" * tokens, token_ids=list(range(tokens)), logprobs=[-0.5] * tokens, top_logprobs=tops)
        for i in range(choices)])


async def _read(url: str, job_id: str) -> tuple[str, bytes]:
    import redis.asyncio as aioredis

    connection = aioredis.Redis.from_url(url)
    try:
        stored = await open_result(connection, job_id)
        assert stored is not None
        return stored.status, b"".join([piece async for piece in stored.pieces])
    finally:
        await connection.aclose()


def test_result_keys_are_read_in_ranges_or_whole(redis_url: str, conn: redis.Redis,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    monkeypatch.setattr(stored_results, "PIECE_BYTES", 300_000)
    raw = _big_result().model_dump_json().encode()
    assert len(raw) > 4 * stored_results.PIECE_BYTES
    conn.set(keys.result_key("big"), raw, ex=3600)
    ranges: list[tuple[int, int]] = []
    real_getrange = redis.asyncio.Redis.getrange

    def counting(self: Any, key: str, start: int, end: int) -> Any:
        ranges.append((start, end))
        return real_getrange(self, key, start, end)

    monkeypatch.setattr(redis.asyncio.Redis, "getrange", counting)
    assert asyncio.run(_read(redis_url, "big")) == ("finished", raw)
    assert len(ranges) >= 5 and all(end - start < stored_results.PIECE_BYTES for start, end in ranges)

    ranges.clear()  # about to expire: read whole at once, not in ranges it could vanish between
    conn.set(keys.result_key("big"), raw, ex=30)
    assert asyncio.run(_read(redis_url, "big")) == ("finished", raw) and len(ranges) == 1  # (the head)

    ranges.clear()  # a writer whose status comes after its choices: read whole, validated
    reordered = json.dumps({"choices": json.loads(raw)["choices"], "id": "big", "status": "finished"}).encode()
    conn.set(keys.result_key("big"), reordered, ex=3600)
    assert asyncio.run(_read(redis_url, "big")) == ("finished", reordered)

    conn.set(keys.result_key("small"), b'{"id": "small", "status": "finished", "choices": "nope"}')
    with pytest.raises(MlxqError, match="malformed"):  # small results are validated whole, as before
        asyncio.run(_read(redis_url, "small"))


# ---------------------------------------------------------------- against a worker and a gateway

LIMIT = 20_000


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, redis.Redis, str]]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start_fake_worker(server.url, "--model", "fake", "--max-tokens-limit", "1000", "--default-max-tokens",
                                   "500", "--max-result-entries", str(LIMIT), step_delay_s=0.0)
        try:
            wait_live(conn, "fake")
            with running_gateway(server.url, max_tokens=1000, max_result_entries=LIMIT) as base:
                yield base.removesuffix("/v1"), conn, server.url
        finally:
            output = stop(worker)
            conn.close()
        print(output[-3000:])


def _wait_job(http: httpx.Client, job_id: str) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + 60
    while (answer := http.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "started"):
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    return answer


def test_the_gateway_and_the_worker_refuse_what_exceeds_the_cap(served: tuple[str, redis.Redis, str]) -> None:
    base, _, _ = served
    http = httpx.Client(base_url=base, timeout=60)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    refused = http.post("/v1/chat/completions", json={**chat, "n": 8, "max_tokens": 500, "logprobs": True,
                                                         "top_logprobs": 9})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    assert "40000 result entries" in refused.json()["error"]["message"] and str(LIMIT) in refused.text
    # Without max_tokens the gateway cannot count it: the worker does, with its default of 500.
    job_id = http.post("/v1/jobs", json={"model": "fake", "prompt": "x", "n": 8, "top_logprobs": 9}).json()["id"]
    ended = _wait_job(http, job_id)
    assert ended["status"] == "failed" and ended["result"]["error"]["type"] == "InvalidRequest"
    assert ended["result"]["error"]["message"].startswith("top_logprobs: n 8 x max_tokens 500 x (1 + top_logprobs 9)")
    job_id = http.post("/v1/jobs", json={"model": "fake", "prompt": "x", "n": 4, "top_logprobs": 9}).json()["id"]
    assert _wait_job(http, job_id)["status"] == "finished"  # 4 x 500 x 10: at the limit


def test_large_results_served_three_ways_are_the_same_answer(served: tuple[str, redis.Redis, str]) -> None:
    base, conn, _ = served
    http = httpx.Client(base_url=base, timeout=120)
    ask = {"model": "fake", "n": 4, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "logprobs": True,
           "top_logprobs": 7, "messages": [{"role": "user", "content": "x"}]}
    streamed = http.post("/v1/chat/completions", json=ask)  # 4 x 600 x 8 entries: sent as it is made
    assert streamed.status_code == 200 and "content-length" not in streamed.headers
    job_id = streamed.headers["x-mlxq-job-id"]
    result = GenerationResult.model_validate_json(conn.get(keys.result_key(job_id)))
    assert len(result.choices) == 4 and all(len(c.top_logprobs[0]) == 7 for c in result.choices)
    body = ChatCompletionRequest.model_validate(ask)
    assert streamed.json() == dump(build_response(body, job_id, result, streamed.json()["created"]))

    submitted = http.post("/v1/jobs", json={k: v for k, v in ask.items() if k != "messages"} | {"prompt": "x"})
    job = _wait_job(http, submitted.json()["id"])
    answer = http.get(f"/v1/jobs/{job['id']}")
    raw = conn.get(keys.result_key(job["id"]))
    assert len(raw) > stored_results.HEAD_BYTES and int(answer.headers["content-length"]) == len(answer.content)
    assert answer.json() == {"id": job["id"], "object": "mlxq.job", "status": "finished",
                             "result": json.loads(raw), "cancelled": None}


# ---------------------------------------------------------------- results read lean

_entry = st.fixed_dictionaries({"token_id": st.integers(-2, 300) | st.text(max_size=2) | st.floats(),
                                "token": _tokens | st.integers(), "logprob": st.floats() | st.text(max_size=2)},
                               optional={"extra": st.integers()})


@settings(max_examples=200, deadline=None)
@given(rows=st.one_of(st.none(), st.lists(st.lists(_entry, max_size=3), max_size=3), st.integers(), st.text(max_size=3)))
def test_a_lean_read_accepts_and_refuses_what_the_whole_read_does(rows: Any) -> None:
    raw = json.dumps({"id": "j", "status": "finished", "choices": [
        {"index": 0, "text": "ab", "token_ids": [1, 2], "logprobs": [-1.0, -2.0], "top_logprobs": rows}]}).encode()
    try:
        whole: GenerationResult | None = parse_result(raw_id := "j", raw)
    except MlxqError:
        whole = None
    if whole is None:
        with pytest.raises(MlxqError, match="malformed"):
            parse_result_lean(raw_id, raw, lean_above=0)
        return
    lean = parse_result_lean(raw_id, raw, lean_above=0)
    assert [list(c.top_logprobs) if c.top_logprobs is not None else None for c in lean.choices] == \
        [c.top_logprobs for c in whole.choices]
    assert [c.model_copy(update={"top_logprobs": None}) for c in lean.choices] == \
        [c.model_copy(update={"top_logprobs": None}) for c in whole.choices]
    assert lean.model_copy(update={"choices": []}) == whole.model_copy(update={"choices": []})


@settings(max_examples=60, deadline=None)
@given(result=results(), chat=st.booleans())
def test_a_response_from_a_lean_read_is_the_same(result: GenerationResult, chat: bool) -> None:
    body = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
            if chat else CompletionRequest(model="m", prompt="x"))
    lean = parse_result_lean("j", result.model_dump_json().encode(), lean_above=0)
    assert b"".join(response_pieces(body, "j", lean, 7, 2)) == b"".join(response_pieces(body, "j", result, 7, 2))


def test_the_dashboard_reads_each_results_timings_from_its_end(redis_url: str, conn: redis.Redis) -> None:
    import asyncio
    import time

    import redis.asyncio as aioredis
    from rq.registry import FinishedJobRegistry

    from producer.fleet_history import TIMINGS_TAIL_BYTES, recent_ttfts
    from schemas.result import ErrorInfo, Timings

    now = time.time()
    big = _big_result().model_copy(update={"timings": Timings(ttft_s=0.25, finished_at=now)})
    small = GenerationResult(id="s", status="finished", custom_id='"timings":{"ttft_s": 9}',
                             timings=Timings(ttft_s=0.5, finished_at=now))
    late = GenerationResult(id="l", status="failed", timings=Timings(ttft_s=0.75, finished_at=now),
                            error=ErrorInfo(type="X", message="y" * 2 * TIMINGS_TAIL_BYTES))  # timings out of reach
    old = GenerationResult(id="o", status="finished", timings=Timings(ttft_s=1.0, finished_at=now - 600))
    for job_id, result in (("big", big), ("small", small), ("late", late), ("old", old)):
        conn.set(keys.result_key(job_id), result.model_dump_json())
        conn.zadd(FinishedJobRegistry.key_template.format("q"), {job_id: now + 100})

    async def read() -> list[float]:
        connection = aioredis.Redis.from_url(redis_url)
        try:
            return await recent_ttfts(connection, ["q"], since=now - 60)
        finally:
            await connection.aclose()

    assert sorted(asyncio.run(read())) == [0.25, 0.5]
