"""Speculative decoding end to end and on the real model (docs/speculative.md): a worker process
started with `--speculative ngram` serves jobs through Redis with the tokens mlx-lm gives each alone
and reports each job's `speculation`; on SmolLM2-135M-Instruct (the `real_model` fixture), a prompt
that asks for text it holds is answered with the same tokens and logprobs as without speculation in
fewer forward passes, by prompt lookup and by the model as its own draft."""

from __future__ import annotations

import json
from typing import Any

import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)

from producer import Client
from schemas import keys
from tests.reference import run_all
from tests.workers import start_worker, stop, wait_for
from worker.scheduler import BatchScheduler

pytestmark = pytest.mark.slow


def test_a_worker_with_speculative_ngram_serves_exact_results_through_redis(redis_url, redis_conn, tiny_model_dir,
                                                                            reference):
    # (a pass is taken to cost 1.25 steps, as on a GPU: on this CPU's default of 2 these rows, whose first
    # proposals miss, would not be worth a pass until they are new again)
    proc = start_worker(redis_url, tiny_model_dir, "--speculative", "ngram", "--speculative-k", "3",
                        "--speculative-pass-cost", "1.25", "--max-num-seqs", "4", name="spec")
    client = Client(redis_url)
    requests = [{"prompt_token_ids": [(i * 37 + k * 11) % 500 + 3 for k in range(6)] * 4, "max_tokens": 20,
                 "temperature": 0, "logprobs": True, "ignore_eos": True} for i in range(3)]
    requests.append({**requests[0], "speculative": False})
    # Four more wait in the queue while the first four fill the worker's slots: rows that end sooner then
    # free their slots for waiting jobs, so a pass is judged by the tokens it adds (graded.py).
    requests += [dict(request) for request in requests]
    try:
        # No row proposes before the verification pass's kernels are built (worker/engines/kernel_prebuild.py);
        # the worker publishes its stats with each round of results, so a one-token job asks.
        def prebuilt() -> bool:
            client.wait(client.submit({"prompt_token_ids": [1, 2, 3], "max_tokens": 1, "temperature": 0}), timeout=60)
            return redis_conn.hget(keys.stats_key("spec"), "engine_kernels_prebuilding") == b"0"

        wait_for(prebuilt, timeout=240, interval=1.0, what="the worker's kernel prebuild to end")
        ids = client.submit_many(requests)
        results = client.wait_many(ids, timeout=300)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    assert "speculation: ngram, up to 3 tokens a row, at most 64 positions a verification pass, a pass costing 1.25" in out
    for job_id, request in zip(ids, requests):
        result = results[job_id]
        assert result.status == "finished", result.error
        tokens, logprobs = reference(request["prompt_token_ids"], request["max_tokens"], True)
        assert result.choices[0].token_ids == tokens
        assert result.choices[0].logprobs == pytest.approx(logprobs, abs=1e-3)
    for job_id in ids[:3]:
        stored = json.loads(redis_conn.get(keys.result_key(job_id)))
        assert stored["speculation"]["drafter"] == "ngram"
        assert 0 < stored["speculation"]["accepted"] <= stored["speculation"]["proposed"]
    assert results[ids[3]].speculation is None  # it opted out


# --- the real model -------------------------------------------------------------------------------
TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, members "
        "agreed to fund the children's reading room, delay the roof repairs until spring, and ask the city for a "
        "grant to replace the old computers.")
GROUNDED = {
    "repeat": {"messages": [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + TEXT}],
               "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    "extract": {"messages": [{"role": "user", "content": "Here is a note:\n\n" + TEXT + "\n\nCopy the sentence that says "
                              "what the members agreed to."}], "max_tokens": 30, "temperature": 0, "logprobs": True},
    "seeded": {"messages": [{"role": "user", "content": "Summarize this note in one sentence:\n\n" + TEXT}],
               "max_tokens": 30, "temperature": 0.7, "top_p": 0.9, "seed": 11, "logprobs": True},
}


@pytest.fixture(scope="module")
def served(real_model: str) -> tuple[Any, Any]:
    from worker.loading import load_model
    from worker.settings import WorkerSettings

    return load_model(WorkerSettings(model=real_model))


def run_real(real_model: str, served, speculative: str, draft: Any = None) -> tuple[dict, dict]:
    from worker.engines.compiled import CompiledEngine
    from worker.engines.speculation import speculator_for
    from worker.loading import build_speculator
    from worker.settings import WorkerSettings

    model, tokenizer = served
    speculator = None
    if speculative == "ngram":
        speculator = build_speculator(WorkerSettings(model=real_model, speculative="ngram"), model, tokenizer)
    elif speculative == "draft":
        from worker.engines.speculation.draft_model import DraftModelDrafter

        speculator = speculator_for(DraftModelDrafter(draft, model.args.vocab_size))
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, speculator=speculator)
    results = run_all(BatchScheduler(engine, max_num_seqs=4), dict(GROUNDED))
    return results, dict(engine.stats().counters)


@pytest.fixture(scope="module")
def without(real_model: str, served) -> tuple[dict, dict]:
    return run_real(real_model, served, "off")


def assert_same_as_without(results: dict, reference: dict) -> None:
    for job_id, theirs in reference.items():
        mine = results[job_id].choices[0]
        assert mine.token_ids == theirs.choices[0].token_ids, job_id
        assert mine.logprobs == pytest.approx(theirs.choices[0].logprobs, abs=1e-4), job_id
        if theirs.choices[0].top_logprobs is not None:
            assert [[t.token_id for t in top] for top in mine.top_logprobs] == \
                [[t.token_id for t in top] for top in theirs.choices[0].top_logprobs]


def test_prompt_lookup_on_the_real_model_is_exact_and_takes_fewer_forward_passes(real_model, served, without):
    results, counters = run_real(real_model, served, "ngram")
    assert_same_as_without(results, without[0])
    assert "Tuesday" in results["repeat"].choices[0].text
    repeat = results["repeat"].speculation
    assert repeat.drafter == "ngram" and repeat.accepted >= len(results["repeat"].choices[0].token_ids) // 4
    assert counters["decode_steps"] < without[1]["decode_steps"]  # (the batch ends with its slowest row)


def test_the_real_model_as_its_own_draft_is_exact(real_model, served, without):
    from worker.loading import load_model
    from worker.settings import WorkerSettings

    draft, _ = load_model(WorkerSettings(model=real_model))
    results, counters = run_real(real_model, served, "draft", draft)
    assert_same_as_without(results, without[0])
    for job_id in ("repeat", "extract"):  # greedy rows: every proposal of the same model is accepted
        stats = results[job_id].speculation
        assert stats.drafter == "draft" and stats.accepted == stats.proposed > 0
    assert counters["decode_steps"] < without[1]["decode_steps"] // 2


def test_an_unrelated_random_draft_of_the_same_tokenizer_is_exact_and_soon_stops(real_model, served, without,
                                                                                 tmp_path):
    """The floor: a random two-layer model made with the real model's tokenizer (`mlxq make-tiny-model
    --tokenizer-from`) proposes nonsense; the answers are unchanged and the rows soon stop proposing."""
    from worker.loading import load_model
    from worker.settings import WorkerSettings
    from worker.tiny_model import make_tiny_model

    draft_dir = make_tiny_model(tmp_path / "draft", tokenizer_from=real_model, seed=3)
    draft, _ = load_model(WorkerSettings(model=str(draft_dir)))
    results, counters = run_real(real_model, served, "draft", draft)
    assert_same_as_without(results, without[0])
    assert sum(r.speculation.accepted for r in results.values() if r.speculation) <= 2
    assert counters["speculative_steps"] <= 2 * len(GROUNDED) + 2  # two misses a row, then off
