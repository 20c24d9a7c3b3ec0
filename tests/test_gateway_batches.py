"""OpenAI Files and Batches through the gateway, with the official `openai` client: the lifecycle, failed
validation, cancel, expiry, tenants, file limits and storage in a directory."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from mlxq.redis_server import RedisServer
from producer.api import keys as api_keys
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_fake_worker, stop

KEYS = {"acme": "sk-acme-batch", "globex": "sk-globex-batch"}


@pytest.fixture(scope="module")
def redis_of_module() -> Iterator[tuple[str, redis.Redis]]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        # a worker's own limit below the gateway's: the line asking more fails in the worker (an error line)
        worker = start_fake_worker(server.url, "--model", "fake", "--max-tokens-limit", "1000", step_delay_s=0.005)
        try:
            wait_live(conn, "fake")
            yield server.url, conn
        finally:
            stop(worker)
            conn.close()


@pytest.fixture(scope="module", params=["redis", "dir"])
def base(request: pytest.FixtureRequest, redis_of_module: tuple[str, redis.Redis],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway, with file contents in Redis, then in a directory."""
    files_dir = str(tmp_path_factory.mktemp("files")) if request.param == "dir" else None
    entries = ",".join(key_entry(t, k) for t, k in KEYS.items())
    with running_gateway(redis_of_module[0], api_keys=entries, files_dir=files_dir, batch_max_in_flight=4,
                         batch_drive_interval_s=0.1, file_max_lines=50, file_max_bytes=20_000) as url:
        yield url


def client(base: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEYS[tenant], max_retries=0)


def request_line(custom_id: str, max_tokens: int = 4, chat: bool = True, **body: Any) -> dict[str, Any]:
    if chat:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "fake", "messages": [{"role": "user", "content": custom_id}], "max_tokens": max_tokens,
                         **body}}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "fake", "prompt": custom_id, "max_tokens": max_tokens, **body}}


def upload(c: openai.OpenAI, lines: list[Any], trailer: bytes = b"\n") -> Any:
    data = b"\n".join(json.dumps(line).encode() if not isinstance(line, bytes) else line for line in lines) + trailer
    return c.files.create(file=("requests.jsonl", io.BytesIO(data), "application/jsonl"), purpose="batch"), data


def wait_batch(c: openai.OpenAI, batch_id: str, states: tuple[str, ...], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in states:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)


def jsonl(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(text) for text in c.files.content(file_id).text.splitlines() if text.strip()]


def test_batch_lifecycle(base: str) -> None:
    c = client(base)
    lines = [request_line(f"req-{i}", chat=i % 2 == 0) for i in range(9)]
    lines.insert(4, b"")  # a blank line is skipped
    lines.append(request_line("refused", chat=False, prompt=None) | {"body": {"model": "fake", "prompt": [3, 999]}})
    uploaded, data = upload(c, lines)
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data) and uploaded.expires_at > time.time()
    assert c.files.retrieve(uploaded.id).id == uploaded.id
    assert c.files.content(uploaded.id).content == data  # the exact bytes back
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"team": "data"})
    assert batch.status == "validating" and batch.metadata == {"team": "data"}
    batch = wait_batch(c, batch.id, ("completed", "failed"))
    assert batch.status == "failed"  # completions lines in a chat batch: validation names each
    assert {e.line for e in batch.errors.data} == {2, 4, 7, 9, 11} and batch.errors.data[0].code == "invalid_request"

    chat_only = [line for line in lines if isinstance(line, bytes) or line["url"] == "/v1/chat/completions"]
    chat_only.append(request_line("refused", max_tokens=2000))
    uploaded, _ = upload(c, chat_only)
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_batch(c, batch.id, ("completed", "failed"))
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 6
    outputs, errors = jsonl(c, batch.output_file_id), jsonl(c, batch.error_file_id)
    assert batch.request_counts.completed == len(outputs) and batch.request_counts.failed == len(errors)
    assert sorted(o["custom_id"] for o in outputs) == ["req-0", "req-2", "req-4", "req-6", "req-8"]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("refused", 400)]
    assert "max_tokens" in errors[0]["response"]["body"]["error"]["message"]
    for out in outputs:
        assert out["response"]["status_code"] == 200
        assert out["response"]["body"]["object"] == "chat.completion"
        assert out["response"]["body"]["choices"][0]["message"]["content"]
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at and batch.finalizing_at
    page = c.batches.list(limit=1)
    assert [b.id for b in page.data] == [batch.id] and page.has_more
    everything = [b.id for b in c.batches.list(limit=1)]  # the SDK follows the pages
    assert everything[:1] == [batch.id] and len(everything) == len(set(everything)) >= 2


def test_validation_fails_a_batch_with_bad_lines(base: str) -> None:
    c = client(base)
    uploaded, _ = upload(c, [request_line("a"), request_line("a"), {**request_line("b"), "url": "/v1/embeddings"},
                             request_line("c", max_tokens=0)])
    batch = wait_batch(c, c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h").id, ("failed", "completed"))
    assert batch.status == "failed" and batch.failed_at
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "duplicate_custom_id", "custom_id"), (3, "invalid_request", "url"), (4, "invalid_request", "body.max_tokens")]


def test_cancel_and_expiry(base: str) -> None:
    c = client(base)
    long_lines = [request_line(f"slow-{i}", max_tokens=1000) for i in range(8)]
    uploaded, _ = upload(c, long_lines)
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(c, batch.id, ("in_progress",))
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_batch(c, batch.id, ("cancelled",))
    errors = jsonl(c, batch.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == sorted(f"slow-{i}" for i in range(8))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and batch.cancelled_at
    assert batch.request_counts.failed == 8 and batch.output_file_id is None

    quick_then_slow = [request_line("quick-0"), request_line("quick-1")] + long_lines
    uploaded, _ = upload(c, quick_then_slow)
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="3s")
    assert batch.expires_at - batch.created_at == 3
    batch = wait_batch(c, batch.id, ("expired",))
    outputs, errors = jsonl(c, batch.output_file_id), jsonl(c, batch.error_file_id)
    assert {o["custom_id"] for o in outputs} == {"quick-0", "quick-1"}
    assert sorted(e["custom_id"] for e in errors) == sorted(f"slow-{i}" for i in range(8))
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert batch.expired_at >= batch.expires_at
    with pytest.raises(openai.BadRequestError) as info:
        c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="soon")
    assert info.value.body["param"] == "completion_window"


def test_files_and_batches_belong_to_their_tenant(base: str, redis_of_module: tuple[str, redis.Redis]) -> None:
    mine, theirs = client(base, "acme"), client(base, "globex")
    uploaded, _ = upload(mine, [request_line("t-0")])
    batch = mine.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: theirs.files.retrieve(uploaded.id), lambda: theirs.files.content(uploaded.id),
                 lambda: theirs.batches.retrieve(batch.id), lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in theirs.batches.list()]
    done = wait_batch(mine, batch.id, ("completed",))
    with pytest.raises(openai.NotFoundError):
        theirs.files.content(done.output_file_id)
    assert jsonl(mine, done.output_file_id)[0]["custom_id"] == "t-0"
    assert not redis_of_module[1].sismember(api_keys.ACTIVE_BATCHES, batch.id)


def test_file_limits(base: str) -> None:
    c = client(base)
    with pytest.raises(openai.BadRequestError) as lines:
        upload(c, [request_line(f"n{i}") for i in range(51)])
    assert "50 lines" in lines.value.body["message"]
    with pytest.raises(openai.APIStatusError) as size:
        upload(c, [request_line("big", stop="x" * 20_000)])
    assert size.value.status_code == 413
    for bad in ([b"not json"], [b"[1, 2]"]):
        with pytest.raises(openai.BadRequestError) as info:
            upload(c, bad)
        assert info.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError) as purpose:
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"
    short = c.files.create(file=("x.jsonl", io.BytesIO(json.dumps(request_line("e")).encode())), purpose="batch",
                           expires_after={"anchor": "created_at", "seconds": 3600})
    assert short.expires_at - short.created_at == 3600
    assert Path  # noqa: B018  (files in a directory: the "dir" run of this module)


def test_files_list_and_delete(base: str) -> None:
    """A data team cleans up: list its files (newest first, by purpose, in pages), delete them; another
    tenant neither sees nor deletes them, and a file an unfinished batch reads is kept until it ends."""
    mine, theirs = client(base, "acme"), client(base, "globex")
    first, _ = upload(mine, [request_line("l-0")])
    second, _ = upload(mine, [request_line("l-1")])
    other, _ = upload(theirs, [request_line("g-0")])
    listed = [f.id for f in mine.files.list()]
    assert listed.index(second.id) < listed.index(first.id) and other.id not in listed
    assert [f.id for f in mine.files.list(order="asc")][-2:] == [first.id, second.id]
    assert other.id in [f.id for f in theirs.files.list()] and first.id not in [f.id for f in theirs.files.list()]
    page = mine.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more
    assert [f.id for f in mine.files.list(limit=1)] == listed  # the SDK follows the pages
    assert {f.purpose for f in mine.files.list(purpose="batch")} == {"batch"}
    assert all(f.purpose == "batch_output" for f in mine.files.list(purpose="batch_output"))

    with pytest.raises(openai.NotFoundError):
        theirs.files.delete(first.id)
    deleted = mine.files.delete(first.id)
    assert deleted.id == first.id and deleted.deleted is True
    for call in (lambda: mine.files.retrieve(first.id), lambda: mine.files.content(first.id),
                 lambda: mine.files.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert first.id not in [f.id for f in mine.files.list()]

    slow, _ = upload(mine, [request_line(f"slow-{i}", max_tokens=1000) for i in range(8)])
    batch = mine.batches.create(input_file_id=slow.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError) as in_use:
        mine.files.delete(slow.id)
    assert in_use.value.body["code"] == "file_in_use" and batch.id in in_use.value.body["message"]
    wait_batch(mine, batch.id, ("in_progress",))
    mine.batches.cancel(batch.id)
    done = wait_batch(mine, batch.id, ("cancelled",))
    assert mine.files.delete(slow.id).deleted and mine.files.delete(done.error_file_id).deleted
    assert {slow.id, done.error_file_id}.isdisjoint(f.id for f in mine.files.list())
