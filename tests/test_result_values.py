"""Every value a result can hold is readable wherever results go: the result key, stream events, the
gateway's jobs, chat and completion responses, batch output lines. A logprob that is not finite (-inf:
a token outside the `processed` distribution's support) is null everywhere; one batch line that cannot
be read or converted is that line's error and never holds up the others or a cancel."""

from __future__ import annotations

import io
import json
import math
import time
from typing import Any, Optional

import httpx
import openai
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from producer import Client
from producer.batchfile import BatchLine, line_text, outcome_line, parse_line
from producer.openai_responses import build_response, dump
from schemas import Choice, GenerationResult, Timings, TopLogprob
from schemas.events import TokenStreamEvent, encode_event, event_data, parse_event
from tests.gateway import announce, key_entry, running_gateway, wait_live
from tests.workers import start_worker, stop

# --- every value a result can hold, through every schema that carries it -----------------------

any_float = st.floats(allow_nan=True, allow_infinity=True)
maybe_float = st.none() | any_float


@st.composite
def choices(draw: Any, index: int) -> Choice:
    token_ids = draw(st.lists(st.integers(0, 2**31 - 1), max_size=6))
    with_logprobs = draw(st.booleans())
    tops = None
    if with_logprobs and draw(st.booleans()):
        tops = [[TopLogprob(token_id=draw(st.integers(0, 2**31 - 1)), token=draw(st.text(max_size=4)),
                            logprob=draw(maybe_float)) for _ in range(draw(st.integers(0, 3)))] for _ in token_ids]
    return Choice(index=index, text=draw(st.text(max_size=20)), token_ids=token_ids,
                  logprobs=[draw(maybe_float) for _ in token_ids] if with_logprobs else None, top_logprobs=tops,
                  finish_reason=draw(st.sampled_from([None, "stop", "length", "cancelled", "timeout", "error"])),
                  constraint_complete=draw(st.sampled_from([None, True, False])))


@st.composite
def results(draw: Any) -> GenerationResult:
    count = draw(st.integers(0, 3))
    return GenerationResult(
        id="job", status=draw(st.sampled_from(["finished", "failed", "cancelled"])),
        choices=[draw(choices(i)) for i in range(count)],
        timings=Timings(**{name: draw(maybe_float) for name in ("enqueued_at", "started_at", "finished_at",
                                                                   "queue_s", "ttft_s", "generation_s")}))


def _numbers(value: Any) -> list[Any]:
    """Every number in a JSON-ready value."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, float) else []


@settings(max_examples=300, deadline=None)
@given(results())
def test_every_result_value_round_trips_and_is_json_everywhere(result: GenerationResult) -> None:
    # What the schema holds is finite or None: nothing the wire cannot carry.
    assert all(math.isfinite(n) for n in _numbers(result.model_dump()))
    # The worker's encoding, the producers' reading: the same result.
    assert GenerationResult.model_validate_json(result.model_dump_json()) == result
    strict = json.loads(result.model_dump_json(), parse_constant=_no_constant)
    assert GenerationResult.model_validate(strict) == result
    for choice in result.choices:
        event = TokenStreamEvent(index=choice.index, token_ids=choice.token_ids, text=choice.text,
                                 logprobs=choice.logprobs, top_logprobs=choice.top_logprobs)
        fields = {k.encode(): v.encode() for k, v in encode_event(event).items()}
        assert parse_event(fields) == event
        json.dumps(event_data(event), allow_nan=False)
    # The gateway's response shapes and a batch's output line, as strict JSON.
    for url, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                 "top_logprobs": 3}),
                      ("/v1/completions", {"prompt": "x", "logprobs": 3})):
        line = parse_line(json.dumps({"custom_id": "c", "method": "POST", "url": url,
                                      "body": {"model": "m", **body}}).encode(), 1, None, url)
        assert isinstance(line, BatchLine), line
        response = dump(build_response(line.body, "job", result, 0))
        json.dumps(response, allow_nan=False)
        _, written = outcome_line(line, "job", result, 0)
        assert json.loads(line_text(written), parse_constant=_no_constant) == written


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


# --- the engines: processed logprobs outside the support --------------------------------------

@pytest.fixture(scope="module", params=["batch-generator", "compiled"])
def engine(tiny_model_dir: str, request: pytest.FixtureRequest) -> Any:
    import worker  # noqa: F401
    from mlx_lm import load

    from worker.engines.compiled import CompiledEngine
    from worker.engines.text import TextEngine

    model, tokenizer = load(tiny_model_dir)
    if request.param == "batch-generator":
        return TextEngine(model, tokenizer, max_num_seqs=8)
    return CompiledEngine(model, tokenizer, max_num_seqs=8)


PROCESSED_TOP_K = {"prompt": "count:", "max_tokens": 6, "temperature": 1.0, "top_k": 3, "seed": 3, "logprobs": True,
                   "top_logprobs": 6, "logprobs_mode": "processed"}
PROCESSED_CONSTRAINED = {"prompt": "letters:", "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 8,
                         "logprobs_mode": "processed", "guided_regex": "[ab]{1,6}"}


def test_processed_logprobs_outside_the_support_are_null_and_the_result_round_trips(engine: Any) -> None:
    from tests.test_structured import run

    results, _ = run(engine, {"top_k": PROCESSED_TOP_K, "constrained": PROCESSED_CONSTRAINED})
    for name, result in results.items():
        assert result.status == "finished", (name, result.error)
        choice = result.choices[0]
        assert choice.logprobs is not None and all(isinstance(lp, float) for lp in choice.logprobs), name
        tops = [top.logprob for step in choice.top_logprobs or [] for top in step]
        assert None in tops, (name, tops)  # top-k 3 of 6 asked; a mask that allows a few letters (and EOS) of 512 tokens
        assert all(lp is None or math.isfinite(lp) for lp in tops)
        assert GenerationResult.model_validate_json(result.model_dump_json()) == result
    # top-k 3: exactly the first three of each step's six are in the support
    for step in results["top_k"].choices[0].top_logprobs or []:
        assert [top.logprob is None for top in step] == [False] * 3 + [True] * 3, step


# --- across processes: a real worker, the gateway, the producer's client ----------------------

TENANT_KEY = "sk-values"


@pytest.mark.slow
def test_null_logprobs_reach_every_reader_and_a_batch_of_them_completes(redis_url: str, tiny_model_dir: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    worker = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", "--max-num-seqs", "8", name="values")
    try:
        wait_live(conn, "values")
        with running_gateway(redis_url, api_keys=key_entry("t", TENANT_KEY), batch_drive_interval_s=0.1) as base:
            answers = _ask_everyone(base, redis_url)
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out
    chat, stream_events, job, waited, output_lines = answers
    # blocking chat: 200, with nulls where the top-k cut
    tops = [top.logprob for entry in chat.choices[0].logprobs.content for top in entry.top_logprobs]
    assert None in tops and all(entry.logprob is not None for entry in chat.choices[0].logprobs.content), tops
    # the stream went to its end (the job was not cancelled), and its logprobs hold nulls
    assert stream_events[-1].choices[0].finish_reason in ("stop", "length"), stream_events[-1]
    streamed = [top.logprob for chunk in stream_events for c in chunk.choices if c.logprobs
                for entry in c.logprobs.content for top in entry.top_logprobs]
    assert None in streamed
    # GET /v1/jobs/{id}: 200 with the result; the producer's own wait reads the same result
    assert job["status"] == "finished" and job["result"]["choices"][0]["top_logprobs"], job
    assert waited.status == "finished" and GenerationResult.model_validate(job["result"]) == waited
    assert any(top.logprob is None for step in waited.choices[0].top_logprobs or [] for top in step)
    # the batch completed, its line strict JSON with nulls
    (line,) = output_lines
    assert line["response"]["status_code"] == 200, line
    assert None in [top["logprob"] for entry in line["response"]["body"]["choices"][0]["logprobs"]["content"]
                    for top in entry["top_logprobs"]]


def _ask_everyone(base: str, redis_url: str) -> tuple[Any, list[Any], dict[str, Any], GenerationResult,
                                                       list[dict[str, Any]]]:
    client = openai.OpenAI(base_url=base, api_key=TENANT_KEY, max_retries=0)
    extra = {"top_k": 3, "logprobs_mode": "processed", "seed": 5}
    chat_args: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8,
                                     temperature=1.0, logprobs=True, top_logprobs=6, extra_body=extra)
    chat = client.chat.completions.create(**chat_args)
    stream_events = list(client.chat.completions.create(stream=True, **chat_args))
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=60)
    created = http.post("/jobs", json={**PROCESSED_TOP_K, "model": "tiny"})
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    waited = Client(redis_url).wait(job_id, timeout=120)
    got = http.get(f"/jobs/{job_id}")
    assert got.status_code == 200, got.text
    line = {"custom_id": "processed", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 8, "temperature": 1.0,
        "logprobs": True, "top_logprobs": 6, **extra}}
    upload = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n"),
                                       "application/jsonl"), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = _wait_batch(client, batch.id, ("completed", "failed", "expired", "cancelled"))
    assert batch.status == "completed", batch
    output = client.files.content(batch.output_file_id).text
    lines = [json.loads(text, parse_constant=_no_constant) for text in output.splitlines() if text.strip()]
    return chat, stream_events, got.json(), waited, lines


def _wait_batch(client: openai.OpenAI, batch_id: str, states: tuple[str, ...], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in states:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)


def test_a_batch_line_whose_result_cannot_be_read_is_its_own_error_and_cancel_completes(redis_url: str) -> None:
    """Results written by hand in place of a worker (the lines' jobs wait on a queue nobody reads): one
    unreadable, one readable with null logprobs. Both lines are written, and the batch's cancel ends
    it, with the lines never run as `batch_cancelled`."""
    conn = redis.Redis.from_url(redis_url)
    announce(conn, "nobody-reads", "idle-model")
    with running_gateway(redis_url, api_keys=key_entry("t", TENANT_KEY), batch_drive_interval_s=0.1,
                         batch_max_in_flight=4) as base:
        client = openai.OpenAI(base_url=base, api_key=TENANT_KEY, max_retries=0)
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "idle-model", "prompt": "x", "max_tokens": 4, "logprobs": 2}} for i in range(4)]
        upload = client.files.create(file=("in.jsonl", io.BytesIO(b"\n".join(json.dumps(x).encode() for x in lines)),
                                           "application/jsonl"), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        job_ids = _wait_for_jobs(conn, batch.id, 4)
        unreadable, readable = job_ids[0], job_ids[1]
        conn.set(f"mlxq:result:{unreadable}", b'{"id": "forged", "status": "finished", "choices": [{"index": 0}]}')
        good = GenerationResult(id=readable, status="finished", choices=[Choice(
            index=0, text="ab", token_ids=[1, 2], logprobs=[-0.5, float("-inf")], finish_reason="length",
            top_logprobs=[[TopLogprob(token_id=1, token="a", logprob=-0.5),
                           TopLogprob(token_id=3, token="c", logprob=float("-inf"))]] * 2)])
        conn.set(f"mlxq:result:{readable}", good.model_dump_json())
        counts = _wait_counts(client, batch.id, 2)
        assert counts.failed == 1 and counts.completed == 1, counts
        client.batches.cancel(batch.id)
        batch = _wait_batch(client, batch.id, ("cancelled", "failed", "completed", "expired"), timeout=30)
        assert batch.status == "cancelled", batch
        output = _lines(client, batch.output_file_id)
        errors = _lines(client, batch.error_file_id)
    by_id = {line["custom_id"]: line for line in output + errors}
    assert set(by_id) == {"line-0", "line-1", "line-2", "line-3"}, by_id
    line_of = {job_id: f"line-{i}" for i, job_id in enumerate(job_ids)}
    bad = by_id[line_of[unreadable]]
    assert bad["response"] is None and bad["error"]["code"] == "result_unreadable", bad
    ok = by_id[line_of[readable]]["response"]["body"]["choices"][0]["logprobs"]
    assert ok["token_logprobs"] == [-0.5, None] and ok["top_logprobs"][0] == {"a": -0.5, "c": None}, ok
    for job_id in job_ids[2:]:
        assert by_id[line_of[job_id]]["error"]["code"] == "batch_cancelled", by_id[line_of[job_id]]


def _lines(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    """A batch file's lines, as strict JSON."""
    return [json.loads(text, parse_constant=_no_constant) for text in client.files.content(file_id).text.splitlines()]


def _wait_for_jobs(conn: redis.Redis, batch_id: str, count: int, timeout: float = 30) -> list[str]:
    """The batch's line jobs, in line order, once the driver has submitted `count` of them."""
    from producer.api import keys as api_keys

    deadline = time.monotonic() + timeout
    while True:
        ids = sorted((k.decode() for k in conn.hkeys(api_keys.batch_in_flight(batch_id))),
                     key=lambda job_id: int(job_id.rsplit("-", 1)[1]))
        if len(ids) >= count:
            return ids
        assert time.monotonic() < deadline, f"{len(ids)} of {count} lines submitted"
        time.sleep(0.05)


def _wait_counts(client: openai.OpenAI, batch_id: str, written: int, timeout: float = 30) -> Optional[Any]:
    deadline = time.monotonic() + timeout
    while True:
        counts = client.batches.retrieve(batch_id).request_counts
        if counts is not None and counts.completed + counts.failed >= written:
            return counts
        assert time.monotonic() < deadline, f"lines written: {counts}"
        time.sleep(0.05)
