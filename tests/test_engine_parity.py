"""The text engine on a real (tiny, random-weight) model: batched greedy output equals the same
request run alone through mlx-lm, including requests that join mid-decode."""

from __future__ import annotations

import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlx_lm import load

from tests.reference import greedy_alone, run_all
from worker.engines.text import TextEngine
from worker.scheduler import BatchScheduler


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load(tiny_model_dir)


def test_batched_greedy_equals_alone_with_mid_decode_arrivals(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    scheduler = BatchScheduler(TextEngine(model, tokenizer, max_num_seqs=8), max_num_seqs=8)
    lengths = [3, 9, 17, 1, 30, 5, 12, 2, 40, 7]
    max_tokens = [12, 5, 20, 9, 3, 16, 7, 25, 4, 11]
    requests = {
        f"j{i}": {
            "prompt_token_ids": [(i * 37 + k * 11) % 500 + 3 for k in range(length)],
            "max_tokens": max_tokens[i],
            "temperature": 0,
            "logprobs": True,
            "ignore_eos": i % 3 == 0,
        }
        for i, length in enumerate(lengths)
    }
    pending = list(requests)
    for job_id in pending[:3]:
        assert scheduler.admit(job_id, requests[job_id]) is None
    pending = pending[3:]
    results = {}
    steps = joined_mid_decode = 0
    while pending or len(scheduler):
        if pending and steps % 2 == 1 and scheduler.free_slots:
            joined_mid_decode += bool(results) or steps > 2
            job_id = pending.pop(0)
            assert scheduler.admit(job_id, requests[job_id]) is None
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        steps += 1
    assert joined_mid_decode >= 5
    eos = set(tokenizer.eos_token_ids)
    for job_id, request in requests.items():
        choice = results[job_id].choices[0]
        stops = set() if request["ignore_eos"] else eos
        ref_tokens, ref_logprobs = greedy_alone(model, request["prompt_token_ids"], request["max_tokens"], stops)
        assert choice.token_ids == ref_tokens, job_id
        assert choice.logprobs == pytest.approx(ref_logprobs, abs=1e-3), job_id
        assert results[job_id].usage.completion_tokens == len(ref_tokens)
        assert results[job_id].usage.prompt_tokens == len(request["prompt_token_ids"])


def test_prompt_is_raw_and_messages_use_the_chat_template(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = TextEngine(model, tokenizer)
    scheduler = BatchScheduler(engine)
    from schemas import GenerationRequest

    raw = GenerationRequest.validate_payload({"prompt": "Hello there"})
    chat = GenerationRequest.validate_payload({"messages": [{"role": "user", "content": "Hello there"}]})
    assert engine.prompt_token_ids(raw) == list(tokenizer.encode("Hello there"))
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>assistant" in templated
    assert engine.prompt_token_ids(chat) == list(tokenizer.encode(templated, add_special_tokens=False))
    parts = GenerationRequest.validate_payload(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]}
    )
    assert engine.prompt_token_ids(parts) == engine.prompt_token_ids(chat)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    failed = scheduler.admit("img", {"messages": [{"role": "user", "content": [image]}]})
    assert failed is not None and "messages[0].content" in failed.error.message


def test_messages_without_a_chat_template_fail_clearly(model_and_tokenizer, tmp_path):
    from worker.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "no-template")
    config = path / "tokenizer_config.json"
    import json

    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    model, tokenizer = load(str(path))
    scheduler = BatchScheduler(TextEngine(model, tokenizer))
    failed = scheduler.admit("m", {"messages": [{"role": "user", "content": "hi"}]})
    assert failed is not None and failed.error.message.startswith("messages: this model has no chat template")
    assert scheduler.admit("p", {"prompt": "hi", "max_tokens": 2}) is None


def _decode_a_while(scheduler: BatchScheduler, long_ids: list[str], steps: int) -> None:
    for job_id in long_ids:
        assert scheduler.admit(job_id, {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 60, "temperature": 0,
                                        "ignore_eos": True}) is None
    for _ in range(steps):
        assert not scheduler.step()


@pytest.mark.parametrize("request_body", [
    {"temperature": 0, "logprobs": True, "top_logprobs": 3},
    {"temperature": 0.9, "seed": 5, "n": 2, "logprobs": True},
    {"temperature": 0.8, "seed": 9, "repetition_penalty": 1.3, "logit_bias": {"17": 4.0}, "logprobs": True},
    {"temperature": 0.8, "seed": 9, "repetition_penalty": 1.3, "logprobs": True, "logprobs_mode": "processed"},
])
def test_a_sequence_joining_a_decoding_batch_gets_its_first_token_in_that_step(model_and_tokenizer, request_body):
    """Its first token is sampled from its own prefill when it joins (not three steps later), and
    its output is what the same request gives alone."""
    model, tokenizer = model_and_tokenizer
    body = {"prompt_token_ids": [(k * 29) % 500 + 3 for k in range(21)], "max_tokens": 9, "ignore_eos": True,
            "stream": True, **request_body}
    alone = run_all(BatchScheduler(TextEngine(model, tokenizer)), {"late": body})["late"]

    scheduler = BatchScheduler(TextEngine(model, tokenizer, max_num_seqs=8), max_num_seqs=8)
    _decode_a_while(scheduler, ["long0", "long1", "long2"], steps=4)
    assert scheduler.admit("late", body) is None
    scheduler.step()
    firsts = [d for d in scheduler.take_stream_deltas() if d.job_id == "late"]
    assert sorted(len(d.token_ids) for d in firsts) == [1] * body.get("n", 1)  # in the step it joined
    joined = run_all(scheduler, {})["late"]

    for a, b in zip(alone.choices, joined.choices):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
        if a.top_logprobs:
            assert [[t.token_id for t in top] for top in b.top_logprobs] == \
                   [[t.token_id for t in top] for top in a.top_logprobs]


def _first_token_in_joining_step(scheduler: BatchScheduler, job_ids: list[str]) -> dict[str, bool]:
    for i, job_id in enumerate(job_ids):
        body = {"prompt_token_ids": [(k * 31 + i) % 500 + 3 for k in range(9)], "max_tokens": 30,
                "ignore_eos": True, "stream": True}
        assert scheduler.admit(job_id, body) is None
    scheduler.step()
    started = {d.job_id for d in scheduler.take_stream_deltas() if d.token_ids}
    return {job_id: job_id in started for job_id in job_ids}


def test_eager_joiners_draw_on_an_allowance_that_refills_with_decode_steps(model_and_tokenizer):
    """A few joiners get their first token in the step they join; a steady stream of them goes to
    the batched prefill (each eager one stalls the batch) until decode steps refill the allowance."""
    from worker.engines.prefill_queue import EAGER_JOINERS_MAX, EAGER_REFILL_STEPS

    model, tokenizer = model_and_tokenizer
    scheduler = BatchScheduler(TextEngine(model, tokenizer, max_num_seqs=16), max_num_seqs=16)
    _decode_a_while(scheduler, ["long0"], steps=3)

    wave = _first_token_in_joining_step(scheduler, [f"a{i}" for i in range(EAGER_JOINERS_MAX + 1)])
    assert sum(wave.values()) == EAGER_JOINERS_MAX  # the allowance, and no more
    assert _first_token_in_joining_step(scheduler, ["b"]) == {"b": False}  # spent
    for _ in range(EAGER_REFILL_STEPS):
        scheduler.step()
    assert _first_token_in_joining_step(scheduler, ["c"]) == {"c": True}  # refilled by decode steps


def test_joiners_past_the_allowance_wait_for_a_prefill_batch_and_match_alone(model_and_tokenizer):
    """Once the eager allowance is spent, joiners of a decoding batch are handed to mlx-lm together:
    when a prefill batch of them waits, or when the oldest has waited JOINER_HOLD_STEPS steps. A
    held joiner can be cancelled, and every output is what the request gives alone."""
    from worker.engines.prefill_queue import EAGER_JOINERS_MAX, JOINER_HOLD_STEPS

    model, tokenizer = model_and_tokenizer
    engine = TextEngine(model, tokenizer, max_num_seqs=32, prefill_batch_size=4)
    scheduler = BatchScheduler(engine, max_num_seqs=32)
    _decode_a_while(scheduler, ["long0"], steps=3)
    _first_token_in_joining_step(scheduler, [f"eager{i}" for i in range(EAGER_JOINERS_MAX)])  # spends it

    def body(i: int) -> dict:
        return {"prompt_token_ids": [(k * 13 + i) % 500 + 3 for k in range(7)], "max_tokens": 12,
                "ignore_eos": True, "stream": True, "temperature": 0}

    first_step: dict[str, int] = {}
    results: dict = {}
    step = 0

    def run_step() -> None:
        nonlocal step
        step += 1
        results.update((ended.id, ended.result()) for ended in scheduler.step())
        for delta in scheduler.take_stream_deltas():
            if delta.token_ids:
                first_step.setdefault(delta.job_id, step)

    for job_id in ("few0", "few1", "gone"):
        assert scheduler.admit(job_id, body(len(job_id) + ord(job_id[-1]))) is None
    run_step()
    cancelled = scheduler.cancel("gone")
    assert cancelled is not None and cancelled.result().status == "cancelled"
    for _ in range(JOINER_HOLD_STEPS - 1):
        run_step()
    assert "few0" not in first_step and "few1" not in first_step  # two are fewer than a prefill batch
    held_at = step
    for _ in range(4):
        run_step()
    assert held_at < first_step["few0"] == first_step["few1"] <= held_at + 4  # the oldest waited enough

    batch = [f"full{i}" for i in range(4)]
    for i, job_id in enumerate(batch):
        assert scheduler.admit(job_id, body(100 + i)) is None
    admitted_at = step
    for _ in range(3):
        run_step()
    assert all(first_step[job_id] <= admitted_at + 3 for job_id in batch)  # a full batch goes at once

    results.update(run_all(scheduler, {}))
    bodies = {"few0": body(len("few0") + ord("0")), "few1": body(len("few1") + ord("1")),
              **{job_id: body(100 + i) for i, job_id in enumerate(batch)}}
    alone = run_all(BatchScheduler(TextEngine(model, tokenizer)), bodies)
    for job_id in bodies:
        assert results[job_id].choices[0].token_ids == alone[job_id].choices[0].token_ids, job_id
    assert engine.num_active == 0
