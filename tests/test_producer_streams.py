"""Token streams and the twin clients: every case runs with `Client` and with `AsyncClient`.

A test here writes what a worker writes (stream entries through schemas.events, the result key,
the done message) at the moment it chooses; tests/test_gateway*.py read streams of real workers.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import pytest
import redis
from rq.job import Job

import producer
from producer import AsyncClient, Client, GenerationResult, InvalidRequest, JobNotFound, StreamExpired, WaitTimeout
from schemas import TopLogprob, keys
from schemas.events import EndStreamEvent, TokenStreamEvent, encode_event
from tests.clients import client, kind, make_client, new_client  # noqa: F401  (fixtures)


def emit(conn: redis.Redis, job_id: str, index: int, token_ids: list[int], text: str) -> None:
    conn.xadd(keys.stream_key(job_id), encode_event(TokenStreamEvent(index=index, token_ids=token_ids, text=text)))


def end(conn: redis.Redis, job_id: str, texts: list[str], status: str = "finished", stream: bool = True) -> None:
    """The worker's last write: result key, the stream's end event, the done message, at once."""
    choices = [{"index": i, "text": t, "token_ids": [ord(c) for c in t], "finish_reason": "stop"}
               for i, t in enumerate(texts)]
    result = GenerationResult(id=job_id, status=status, choices=choices)  # type: ignore[arg-type]
    with conn.pipeline() as pipe:
        pipe.set(keys.result_key(job_id), result.model_dump_json(), ex=60)
        if stream:
            pipe.xadd(keys.stream_key(job_id), encode_event(
                EndStreamEvent(status=status, finish_reasons=["stop"] * len(texts))))  # type: ignore[arg-type]
        pipe.publish(keys.done_channel(job_id), job_id)
        pipe.execute()


def test_the_clients_are_twins() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {name: inspect.signature(member) for name, member in vars(cls).items()
                if callable(member) and not name.startswith("_")}

    sync, asynchronous = public(Client), public(AsyncClient)
    assert set(sync) == set(asynchronous)
    for name, signature in sync.items():
        assert asynchronous[name].parameters == signature.parameters, name
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) == (name not in ("stream",)), name
    assert inspect.signature(Client.__init__).parameters.keys() == inspect.signature(AsyncClient.__init__).parameters.keys()
    assert {"__enter__", "__exit__"} <= set(vars(Client)) and {"__aenter__", "__aexit__"} <= set(vars(AsyncClient))
    assert "AsyncClient" in producer.__all__


def test_stream_yields_events_then_ends(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x", "stream": True, "n": 2})
    writer = threading.Timer(0.3, lambda: (emit(redis_conn, job_id, 0, [104], "h"), emit(redis_conn, job_id, 1, [121], "y"),
                                           emit(redis_conn, job_id, 0, [105], "i"), end(redis_conn, job_id, ["hi", "y"])))
    writer.start()
    stream = client.stream(job_id, timeout=30)
    events = list(stream)
    writer.join()
    assert events == [
        {"event": "token", "index": 0, "token_ids": [104], "text": "h"},
        {"event": "token", "index": 1, "token_ids": [121], "text": "y"},
        {"event": "token", "index": 0, "token_ids": [105], "text": "i"},
        {"event": "end", "status": "finished", "finish_reasons": ["stop", "stop"]},
    ]
    last_real = redis_conn.xrevrange(keys.stream_key(job_id), count=1)[0][0].decode()
    assert stream.last_event_id == last_real


def test_stream_resumes_after_the_last_event_id(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x", "stream": True})
    for piece in "abc":
        emit(redis_conn, job_id, 0, [ord(piece)], piece)
    first = client.stream(job_id, timeout=30)
    seen = [next(first), next(first)]  # then the connection "drops"
    resumed = client.stream(job_id, timeout=30, last_event_id=first.last_event_id)
    end(redis_conn, job_id, ["abcd"])
    rest = list(resumed)
    assert [e["text"] for e in seen] == ["a", "b"]
    assert [e.get("text") for e in rest] == ["c", None] and rest[-1]["event"] == "end"


def test_a_job_without_a_stream_yields_its_result(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x", "n": 2})
    threading.Timer(0.3, end, (redis_conn, job_id, ["one", "two"]), {"stream": False}).start()
    stream = client.stream(job_id, timeout=30)
    events = list(stream)
    assert events == [
        {"event": "token", "index": 0, "token_ids": [111, 110, 101], "text": "one"},
        {"event": "token", "index": 1, "token_ids": [116, 119, 111], "text": "two"},
        {"event": "end", "status": "finished", "finish_reasons": ["stop", "stop"]},
    ]
    assert stream.last_event_id == "0-3"
    # resuming after the first made-up event yields the rest, once
    assert [e["event"] for e in client.stream(job_id, timeout=5, last_event_id="0-1")] == ["token", "end"]
    assert list(client.stream(job_id, timeout=5, last_event_id="0-3")) == []


def test_token_events_carry_logprobs_when_asked(client: Any, redis_conn: redis.Redis) -> None:
    """The logprob fields are in an entry only when it has them, so a stream without logprobs reads as
    it always did; with them, a reader gets them per token, as the result's choice has them."""
    plain = encode_event(TokenStreamEvent(index=0, token_ids=[1], text="a"))
    assert plain == {"data": '{"event":"token","index":0,"token_ids":[1],"text":"a"}'}
    job_id = client.submit({"prompt": "x", "stream": True, "logprobs": True, "top_logprobs": 1})
    tops = [[TopLogprob(token_id=104, token="h", logprob=-0.5)], [TopLogprob(token_id=1, token="?", logprob=-0.1)]]
    redis_conn.xadd(keys.stream_key(job_id), encode_event(TokenStreamEvent(
        index=0, token_ids=[104, 105], text="hi", logprobs=[-0.5, -2.0], top_logprobs=tops)))
    end(redis_conn, job_id, ["hi"])
    token, last = list(client.stream(job_id, timeout=30))
    assert token == {"event": "token", "index": 0, "token_ids": [104, 105], "text": "hi", "logprobs": [-0.5, -2.0],
                     "top_logprobs": [[{"token_id": 104, "token": "h", "logprob": -0.5}],
                                      [{"token_id": 1, "token": "?", "logprob": -0.1}]]}
    assert last["event"] == "end"


def test_streamed_chunks_carry_their_own_logprobs() -> None:
    """The gateway's chunks: each token chunk with its tokens' logprobs in OpenAI's shape, the finish
    chunk without; from events that carry none (an older worker), all of them with the finish chunk."""
    from producer.openai_requests import ChatCompletionRequest, CompletionRequest
    from producer.openai_responses import ChunkWriter

    tops = [[{"token_id": 104, "token": "h", "logprob": -0.5}], [{"token_id": 7, "token": "!", "logprob": -0.1}]]
    event = {"event": "token", "index": 0, "token_ids": [104, 105], "text": "hi", "logprobs": [-0.5, -2.0],
             "top_logprobs": tops}
    result = GenerationResult(id="j", status="finished", choices=[  # type: ignore[list-item]
        {"index": 0, "text": "hi", "token_ids": [104, 105], "logprobs": [-0.5, -2.0], "top_logprobs": tops,
         "finish_reason": "length"}])
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True,  # type: ignore[list-item]
                                 logprobs=True, top_logprobs=1)
    writer = ChunkWriter(chat, "j", 0)
    content = writer.token(event)["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], [t["token"] for t in c["top_logprobs"]]) for c in content] == [
        ("h", -0.5, ["h"]), ("token_id:105", -2.0, ["!"])]
    assert writer.closing(result)[0]["choices"][0]["logprobs"] is None
    older = ChunkWriter(chat, "j", 0)
    assert older.token({k: v for k, v in event.items() if "logprobs" not in k})["choices"][0]["logprobs"] is None
    assert older.closing(result)[0]["choices"][0]["logprobs"]["content"] == content

    completion = ChunkWriter(CompletionRequest(model="m", prompt="x", stream=True, logprobs=1), "j", 0)
    halves = [completion.token({**event, "token_ids": ids, "logprobs": lps, "top_logprobs": [top]})
              for ids, lps, top in zip([[104], [105]], [[-0.5], [-2.0]], tops)]
    assert [h["choices"][0]["logprobs"]["text_offset"] for h in halves] == [[0], [1]]
    assert [h["choices"][0]["logprobs"]["tokens"] for h in halves] == [["h"], ["token_id:105"]]


def test_token_events_read_together_make_one_chunk_per_choice() -> None:
    """What the gateway sends a client it fell behind on: each choice's tokens, texts and logprobs
    joined in order, the chunks' logprobs those of the events one by one, nothing moved past an end."""
    from producer.openai_requests import ChatCompletionRequest
    from producer.openai_responses import ChunkWriter, merge_token_events

    def token(index: int, token_id: int, logprob: float) -> dict[str, Any]:
        return {"event": "token", "index": index, "token_ids": [token_id], "text": chr(token_id),
                "logprobs": [logprob], "top_logprobs": [[{"token_id": token_id, "token": chr(token_id), "logprob": logprob}]]}

    events = [token(0, 104, -0.1), token(1, 121, -0.2), token(0, 105, -0.3), token(1, 111, -0.4),
              {"event": "end", "status": "finished", "finish_reasons": ["stop", "stop"]}, token(0, 33, -0.5)]
    merged = merge_token_events(events)
    assert [(e["event"], e.get("index"), e.get("text")) for e in merged] == [
        ("token", 0, "hi"), ("token", 1, "yo"), ("end", None, None), ("token", 0, "!")]
    assert merged[0]["token_ids"] == [104, 105] and merged[0]["logprobs"] == [-0.1, -0.3]
    assert events[0]["token_ids"] == [104]  # the events themselves are left as they were
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True,  # type: ignore[list-item]
                                 logprobs=True, top_logprobs=1)
    one_by_one = ChunkWriter(chat, "j", 0)
    separate = [one_by_one.token(e)["choices"][0]["logprobs"]["content"] for e in events[:4] if e["index"] == 0]
    joined = ChunkWriter(chat, "j", 0).token(merged[0])["choices"][0]["logprobs"]["content"]
    assert joined == separate[0] + separate[1]
    without = [{k: v for k, v in e.items() if "logprobs" not in k} for e in events[:4]]
    assert [e["text"] for e in merge_token_events([events[0], without[2]])] == ["h", "i"]  # unlike events stay apart


def test_stream_ends_on_cancel_and_on_rq_failure(client: Any, redis_conn: redis.Redis) -> None:
    queued = client.submit({"prompt": "x", "stream": True})
    client.cancel(queued)
    assert list(client.stream(queued, timeout=10)) == [{"event": "end", "status": "cancelled", "finish_reasons": []}]

    # A worker that streamed a token, then died; RQ's cleanup failed the job without a result.
    dead = client.submit({"prompt": "y", "stream": True})
    emit(redis_conn, dead, 0, [1], "a")
    redis_conn.lrem("rq:queue:mlxq", 1, dead)
    redis_conn.hset(Job.key_for(dead), "status", "failed")
    events = list(client.stream(dead, timeout=10))
    assert events == [{"event": "token", "index": 0, "token_ids": [1], "text": "a"},
                      {"event": "end", "status": "failed", "finish_reasons": []}]


def test_stream_errors(client: Any, redis_conn: redis.Redis) -> None:
    with pytest.raises(JobNotFound):
        list(client.stream("nope", timeout=5))
    job_id = client.submit({"prompt": "x", "stream": True})
    start = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        list(client.stream(job_id, timeout=0.5))
    assert 0.45 <= time.monotonic() - start < 5 and info.value.pending == (job_id,)

    # The stream expired after part of it was read: a clear error, not a hang nor a silent gap.
    emit(redis_conn, job_id, 0, [1], "a")
    stream = client.stream(job_id, timeout=10)
    next(stream)
    end(redis_conn, job_id, ["ab"], stream=False)
    redis_conn.delete(keys.stream_key(job_id))
    with pytest.raises(StreamExpired) as expired:
        next(stream)
    assert expired.value.job_id == job_id and isinstance(expired.value, LookupError)


@pytest.mark.parametrize("bad", ["99999999999999999999", "1\u00b2", "1-", "-1", "1-2-3", " 1"])
def test_a_last_event_id_redis_would_refuse_is_refused_naming_it(client: Any, bad: str) -> None:
    job_id = client.submit({"prompt": "x", "stream": True})
    with pytest.raises(InvalidRequest, match="last_event_id") as info:
        client.stream(job_id, timeout=5, last_event_id=bad)
    assert info.value.field == "last_event_id"
    resumed = client.stream(job_id, timeout=5, last_event_id="18446744073709551615-18446744073709551615")
    assert resumed.last_event_id == "18446744073709551615-18446744073709551615"  # the largest id Redis has


def test_a_stream_read_another_client_unblocks_with_an_error_reads_on(client: Any, redis_conn: redis.Redis) -> None:
    """`CLIENT UNBLOCK <id> ERROR` from another client, at a stream's blocking read, costs it nothing."""
    job_id = client.submit({"prompt": "x", "stream": True})
    emit(redis_conn, job_id, 0, [1], "a")
    stream = client.stream(job_id, timeout=30)
    assert next(stream)["text"] == "a"
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.extend(_drain(stream)))
    reader.start()
    for i in range(20):
        time.sleep(0.05)
        for blocked in [int(c["id"]) for c in redis_conn.client_list() if c.get("cmd") == "xread"]:
            redis_conn.execute_command("CLIENT", "UNBLOCK", blocked, "ERROR")
        emit(redis_conn, job_id, 0, [2 + i], "b")
    end(redis_conn, job_id, ["a" + "b" * 20])
    reader.join(timeout=30)
    assert [e.get("text") for e in got] == ["b"] * 20 + [None] and got[-1]["event"] == "end", got


def _drain(stream: Any) -> list[Any]:
    try:
        return list(stream)
    except Exception as exc:  # shown by the assertion
        return [exc]


def test_blocking_reads_outlast_the_socket_timeout(redis_url: str, redis_conn: redis.Redis) -> None:
    """redis-py cuts any read at its socket timeout (5 s by default): a stream silent for 6 s and a
    wait of 6 s still end as their callers asked, with both clients (issue 19, point 6)."""
    clients = {kind_: make_client(kind_, redis_url) for kind_ in ("sync", "async")}
    assert redis.Redis.from_url(redis_url).connection_pool.make_connection().socket_timeout == 5
    jobs = {(kind_, what): c.submit({"prompt": what, "stream": what == "stream"})
            for kind_, c in clients.items() for what in ("stream", "wait")}
    got: dict[tuple[str, str], Any] = {}

    def read(kind_: str, what: str) -> None:
        job_id = jobs[(kind_, what)]
        try:
            if what == "stream":
                got[(kind_, what)] = list(clients[kind_].stream(job_id, timeout=30))
            else:
                got[(kind_, what)] = clients[kind_].wait(job_id, timeout=30).status
        except Exception as exc:  # reported below
            got[(kind_, what)] = exc

    readers = [threading.Thread(target=read, args=key) for key in jobs]
    for thread in readers:
        thread.start()
    time.sleep(6.0)
    for (kind_, what), job_id in jobs.items():
        if what == "stream":
            emit(redis_conn, job_id, 0, [1], "late")
        end(redis_conn, job_id, ["late"], stream=what == "stream")
    for thread in readers:
        thread.join(timeout=20)
    for c in clients.values():
        c.close()
    for kind_ in clients:
        assert got[(kind_, "wait")] == "finished", got
        assert [e["event"] for e in got[(kind_, "stream")]] == ["token", "end"], got


def test_many_streams_at_once_on_one_async_client(redis_url: str, redis_conn: redis.Redis) -> None:
    """More streams read at once than redis-py's default pool has connections (100): each blocking read
    holds one, and the client's pool waits for a free one rather than failing."""
    import asyncio

    async def main() -> list[list[dict[str, Any]]]:
        async with AsyncClient(redis_url) as client:
            ids = await client.submit_many([{"prompt": "x", "stream": True}] * 150)
            readers = [asyncio.ensure_future(_read_all(client, job_id)) for job_id in ids]
            await asyncio.sleep(0.5)  # every reader is in its blocking read
            for job_id in ids:
                emit(redis_conn, job_id, 0, [104], "h")
                end(redis_conn, job_id, ["h"])
            return list(await asyncio.gather(*readers))

    streams = asyncio.run(main())
    assert all([e["event"] for e in events] == ["token", "end"] for events in streams)


async def _read_all(client: AsyncClient, job_id: str) -> list[dict[str, Any]]:
    return [event async for event in client.stream(job_id, timeout=30)]
