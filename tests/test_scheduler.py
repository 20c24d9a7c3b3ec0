"""BatchScheduler on the deterministic fake engine: admission, results, cancellation."""

from __future__ import annotations

from schemas import GenerationResult, RequestLimits
from worker.engines.fake import EOS, FakeEngine, fake_token
from worker.scheduler import BatchScheduler, EndedJob


def run_to_end(scheduler: BatchScheduler, max_steps: int = 1000) -> dict[str, GenerationResult]:
    results: dict[str, GenerationResult] = {}
    for _ in range(max_steps):
        if not len(scheduler):
            break
        for ended in scheduler.step():
            results[ended.id] = ended.result()
    return results


def make(**kwargs) -> BatchScheduler:
    return BatchScheduler(FakeEngine(), worker_name="w1", model_name="fake", **kwargs)


def test_tokens_usage_and_timings_follow_the_engine():
    scheduler = make()
    assert scheduler.admit("a", {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0}, enqueued_at=1.0) is None
    result = run_to_end(scheduler)["a"]
    expected = [fake_token([5, 6, 7], i) for i in range(4)]
    assert result.status == "finished"
    assert result.choices[0].token_ids == expected
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 4 and result.usage.total_tokens == 7
    assert result.worker == "w1" and result.model == "fake"
    t = result.timings
    assert t.enqueued_at == 1.0 and t.started_at <= t.finished_at and t.queue_s > 0 and t.ttft_s >= 0


def test_an_ended_job_built_later_equals_one_built_at_once():
    """The worker builds results on its bookkeeping thread, steps after the job ended: what the
    scheduler does meanwhile must not change them."""
    requests = {"short": {"prompt_token_ids": [5, 6], "max_tokens": 3, "temperature": 0},
                "long": {"prompt_token_ids": [9], "max_tokens": 12, "temperature": 0}}
    at_once = run_to_end(_admitted(make(), requests))
    scheduler = _admitted(make(), requests)
    kept, steps_after = {}, {}
    while len(scheduler):
        for name in kept:
            steps_after[name] += 1
        for ended in scheduler.step():
            assert ended.status == "finished"
            kept[ended.id], steps_after[ended.id] = ended, 0
    assert steps_after["short"] >= 5  # it was built long after it ended, while others ran
    for name in requests:
        later = kept[name].result()
        assert later.model_dump(exclude={"timings"}) == at_once[name].model_dump(exclude={"timings"})
        assert later.choices[0].text and later.timings.finished_at <= kept["long"].result().timings.finished_at
        assert kept[name].result() is later  # built once


def _admitted(scheduler: BatchScheduler, requests: dict) -> BatchScheduler:
    for job_id, request in requests.items():
        assert scheduler.admit(job_id, request) is None
    return scheduler


def test_eos_is_in_token_ids_but_not_in_text():
    scheduler = make()
    scheduler.admit("e", {"prompt_token_ids": [255, 1], "max_tokens": 10})
    choice = run_to_end(scheduler)["e"].choices[0]
    assert choice.token_ids[-1] == EOS and len(choice.token_ids) == 3
    assert choice.finish_reason == "stop"
    assert choice.text == FakeEngine().decode(choice.token_ids[:-1])


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make()
    scheduler.admit("e", {"prompt_token_ids": [255, 1], "max_tokens": 6, "ignore_eos": True})
    choice = run_to_end(scheduler)["e"].choices[0]
    assert len(choice.token_ids) == 6 and choice.finish_reason == "length"


def test_invalid_requests_fail_at_admission_and_name_the_field():
    scheduler = make(limits=RequestLimits(max_tokens=100, max_prompt_tokens=8), served_names={"fake", "org/fake"})
    cases = {
        "schema": ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        "unknown": ({"prompt": "x", "bogus": 1}, "bogus"),
        "not-object": (["prompt"], "request"),
        "limit": ({"prompt": "x", "max_tokens": 101}, "max_tokens"),
        "long-prompt": ({"prompt": "abcdefghijk"}, "prompt"),
        "vocab": ({"prompt_token_ids": [1, 999]}, "prompt_token_ids"),
        "model": ({"prompt": "x", "model": "other"}, "model"),
    }
    for job_id, (payload, field) in cases.items():
        result = scheduler.admit(job_id, payload)
        assert result is not None, job_id
        assert result.status == "failed" and result.error is not None
        assert field in result.error.message, (job_id, result.error.message)
    assert len(scheduler) == 0
    assert scheduler.admit("ok", {"prompt": "x", "model": "org/fake", "max_tokens": 2}) is None


def test_bad_job_does_not_disturb_running_neighbours():
    scheduler = make()
    scheduler.admit("good", {"prompt_token_ids": [1, 2], "max_tokens": 5, "temperature": 0})
    scheduler.step()
    assert scheduler.admit("bad", {"prompt_token_ids": [1, 9999]}) is not None
    result = run_to_end(scheduler)["good"]
    assert result.choices[0].token_ids == [fake_token([1, 2], i) for i in range(5)]


def test_n_choices_and_capacity():
    scheduler = make(max_num_seqs=8)
    scheduler.admit("n", {"prompt_token_ids": [3], "max_tokens": 2, "n": 3})
    assert scheduler.num_sequences == 3 and scheduler.free_slots == 5
    result = run_to_end(scheduler)["n"]
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage.prompt_tokens == 1 and result.usage.completion_tokens == 6


def test_cancel_keeps_partial_output_and_frees_slots():
    scheduler = make(max_num_seqs=4)
    scheduler.admit("c", {"prompt_token_ids": [4], "max_tokens": 100})
    for _ in range(4):
        scheduler.step()
    ended = scheduler.cancel("c")
    assert ended is not None and ended.status == "cancelled"
    result = ended.result()
    assert result.status == "cancelled"
    assert result.choices[0].finish_reason == "cancelled" and len(result.choices[0].token_ids) == 3
    assert scheduler.free_slots == 4 and scheduler.engine.num_active == 0


def test_timeout_fails_with_partial_output():
    scheduler = make()
    scheduler.admit("t", {"prompt_token_ids": [4], "max_tokens": 100})
    scheduler.step()
    scheduler.step()
    result = scheduler.cancel("t", "timeout").result()
    assert result.status == "failed" and result.error.type == "JobTimeoutException"
    assert result.choices[0].finish_reason == "timeout" and result.choices[0].token_ids


def test_abort_all_fails_every_running_job():
    scheduler = make()
    for i in range(3):
        scheduler.admit(f"j{i}", {"prompt_token_ids": [i + 1], "max_tokens": 50})
    scheduler.step()
    results = [ended.result() for ended in scheduler.abort_all("EngineError", "boom")]
    assert sorted(r.id for r in results) == ["j0", "j1", "j2"]
    assert all(r.status == "failed" and r.error.message == "boom" for r in results)
    assert len(scheduler) == 0


def test_kv_budget_rejects_what_can_never_fit_and_queues_what_fits_later():
    engine = FakeEngine(kv_bytes_per_token=1000)
    scheduler = BatchScheduler(engine, max_num_seqs=8, kv_budget_bytes=20 * 1000)
    too_big = scheduler.admit("big", {"prompt_token_ids": [1] * 5, "max_tokens": 16})  # 21 tokens
    assert too_big is not None and too_big.error.type == "InvalidRequest"
    assert "max_tokens" in too_big.error.message and "MLXQ_KV_BUDGET_MB" in too_big.error.message
    too_many = scheduler.admit("n", {"prompt_token_ids": [1] * 2, "max_tokens": 8, "n": 2})  # 2 x 10 fits
    assert too_many is None
    run_to_end(scheduler)
    # 12 tokens each: one fits (12k), two padded rows (2 x 12k) do not: the second waits its turn
    assert scheduler.admit("a", {"prompt_token_ids": [1, 2], "max_tokens": 10}) is None
    assert scheduler.admit("b", {"prompt_token_ids": [3, 4], "max_tokens": 10}) is None
    assert engine.num_active == 0  # admitted jobs enter the engine together, at the next step
    results = {ended.id: ended.result() for ended in scheduler.step()}
    assert engine.num_active == 1 and scheduler.free_slots == 6
    max_active = 0
    while len(scheduler):
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        max_active = max(max_active, engine.num_active)
    assert max_active == 1
    assert all(len(r.choices[0].token_ids) == 10 for r in results.values())


def test_n_above_max_num_seqs_is_rejected():
    scheduler = BatchScheduler(FakeEngine(), max_num_seqs=4)
    result = scheduler.admit("n", {"prompt_token_ids": [1], "n": 5})
    assert result is not None and "MLXQ_MAX_NUM_SEQS" in result.error.message and "n:" in result.error.message


def test_a_solo_job_runs_alone():
    scheduler = make(max_num_seqs=8)
    scheduler.admit("a", {"prompt_token_ids": [1], "max_tokens": 3})
    scheduler.admit("solo", {"prompt_token_ids": [2], "max_tokens": 3}, solo=True)
    scheduler.step()
    assert scheduler.engine.num_active == 1 and scheduler.free_slots == 0
    seen_together = False
    while len(scheduler):
        scheduler.step()
        seen_together |= scheduler.engine.num_active > 1
    assert not seen_together


def test_reset_forgets_the_jobs_in_the_engine_and_keeps_the_waiting_ones():
    scheduler = make()
    scheduler.admit("a", {"prompt_token_ids": [1], "max_tokens": 30})
    scheduler.admit("b", {"prompt_token_ids": [2], "max_tokens": 30})
    scheduler.admit("solo", {"prompt_token_ids": [3], "max_tokens": 3}, solo=True)  # waits: batch not empty
    scheduler.step()
    assert sorted(scheduler.reset()) == ["a", "b"]
    assert scheduler.job_ids == ["solo"] and scheduler.engine.num_active == 0
    results = run_to_end(scheduler)
    assert results["solo"].status == "finished" and len(results["solo"].choices[0].token_ids) == 3


def test_a_result_that_cannot_be_built_is_a_failed_one():
    def broken() -> GenerationResult:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    result = EndedJob("j", "finished", broken).result()
    assert result.id == "j" and result.status == "failed"
    assert result.error is not None and result.error.type == "ResultError" and "UnicodeDecodeError" in result.error.message
