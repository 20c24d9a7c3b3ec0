"""The compiled decode path (worker/engines/compiled.py) on tiny random models: batched output is
what mlx-lm gives each request alone, at every batch composition and bucket boundary, for every
architecture it covers; the others fall back to mlx-lm's BatchGenerator, and the worker says so.
(tests/test_sampling.py runs the per-row sampling tests on this engine too.)"""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlx_lm import load

from tests.reference import greedy_alone, run_all
from worker.engines import compiled, step_sampling
from worker.engines.compiled import CompiledEngine
from worker.engines.decode_path import choose_decode_path
from worker.engines.decode_step import bucket, ladder
from worker.engines.text import TextEngine
from worker.scheduler import BatchScheduler
from worker.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load(tiny_model_dir)


@pytest.fixture(autouse=True, params=["decode-step", "prefill"], ids=["first-token-from-a-step", "from-the-prefill"])
def first_token_from(request, monkeypatch):
    """Every test runs twice: the first token sampled by a decode step (the CPU's way) and from
    the prefill's logits (a GPU's way)."""
    monkeypatch.setattr(compiled, "first_token_from_prefill_by_default", lambda: request.param == "prefill")
    return request.param


def prompt_ids(i: int, length: int) -> list[int]:
    return [(i * 37 + k * 11) % 500 + 3 for k in range(length)]


def assert_matches_alone(model, requests: dict, results: dict, eos: set[int]) -> None:
    for job_id, request in requests.items():
        choice = results[job_id].choices[0]
        stops = set() if request.get("ignore_eos") else eos
        tokens, logprobs = greedy_alone(model, request["prompt_token_ids"], request["max_tokens"], stops)
        assert choice.token_ids == tokens, job_id
        assert choice.logprobs == pytest.approx(logprobs, abs=1e-3), job_id


def test_the_first_token_comes_from_the_prefill_by_default_on_cuda_alone(monkeypatch):
    """The platform branch (the autouse fixture replaces it for every other test here)."""
    monkeypatch.undo()

    class Cuda:
        def __init__(self, available: bool) -> None:
            self.is_available = lambda: available

    monkeypatch.setattr(compiled.mx, "cuda", Cuda(True), raising=False)
    assert compiled.first_token_from_prefill_by_default()
    monkeypatch.setattr(compiled.mx, "cuda", Cuda(False))
    assert not compiled.first_token_from_prefill_by_default()
    monkeypatch.delattr(compiled.mx, "cuda")  # a build without the CUDA module (Metal)
    assert not compiled.first_token_from_prefill_by_default()


def test_the_bucket_ladder_pads_by_at_most_a_third():
    assert ladder(32) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert ladder(700, 128) == [128, 192, 256, 384, 512, 768]
    assert [bucket(n, 128) for n in (1, 128, 129, 193, 1000)] == [128, 128, 192, 256, 1024]


def test_greedy_matches_alone_while_rows_join_and_cross_batch_and_length_buckets(model_and_tokenizer):
    """One request joins every step (the batch grows through the slot buckets 1, 2, 3, 4, 6, 8),
    short rows finish and free their slots for later ones, and a long prompt crosses the length
    bucket of 128 positions into 192 while the others decode."""
    model, tokenizer = model_and_tokenizer
    engine = CompiledEngine(model, tokenizer, max_num_seqs=8)
    scheduler = BatchScheduler(engine, max_num_seqs=8)
    lengths = [3, 9, 17, 1, 120, 5, 12, 2, 40, 7, 25, 4]
    max_tokens = [12, 5, 20, 9, 30, 16, 7, 25, 4, 11, 6, 14]
    requests = {f"j{i}": {"prompt_token_ids": prompt_ids(i, n), "max_tokens": max_tokens[i], "temperature": 0,
                          "logprobs": True, "ignore_eos": i % 3 == 0} for i, n in enumerate(lengths)}
    pending, results = list(requests), {}
    while pending or len(scheduler):
        if pending and scheduler.free_slots:
            job_id = pending.pop(0)
            assert scheduler.admit(job_id, requests[job_id]) is None
        results.update((ended.id, ended.result()) for ended in scheduler.step())
    assert_matches_alone(model, requests, results, set(tokenizer.eos_token_ids))
    shapes = engine.compiled_shapes
    slots = {slots for slots, _ in shapes}
    assert {1, 8} <= slots and len(slots) >= 4  # it grew through the slot buckets
    assert {128, 192} <= {length for _, length in shapes}
    assert engine.num_active == 0 and engine.stats().counters["slot_buffer_bytes"] == 0  # idle: given back


def test_prompts_that_fill_their_length_bucket_decode_past_it_exactly(model_and_tokenizer):
    """A prompt of exactly one length bucket: the step that samples its first token writes the
    bucket's last position, so every later step needs bigger buffers before it is launched (a step
    launched into the old ones wrote past their end). From idle, and joining a decoding batch."""
    model, tokenizer = model_and_tokenizer
    scheduler = BatchScheduler(CompiledEngine(model, tokenizer, max_num_seqs=4), max_num_seqs=4)
    full = {"prompt_token_ids": prompt_ids(5, 128), "max_tokens": 6, "temperature": 0, "logprobs": True,
            "ignore_eos": True}
    results = run_all(scheduler, {"from-idle": full})
    assert scheduler.admit("long", {"prompt_token_ids": prompt_ids(2, 60), "max_tokens": 30, "temperature": 0,
                                    "logprobs": True, "ignore_eos": True}) is None
    for _ in range(3):
        scheduler.step()
    joiner = {**full, "prompt_token_ids": prompt_ids(6, 128)}
    assert scheduler.admit("joiner", joiner) is None
    results.update(run_all(scheduler, {}))
    assert_matches_alone(model, {"from-idle": full, "joiner": joiner}, results, set())


@pytest.mark.parametrize("request_body", [
    {"temperature": 0, "logprobs": True, "top_logprobs": 3},
    {"temperature": 0.9, "seed": 5, "n": 2, "logprobs": True},
    {"temperature": 0.8, "seed": 9, "repetition_penalty": 1.3, "logit_bias": {"17": 4.0}, "logprobs": True},
    {"temperature": 0.8, "seed": 9, "presence_penalty": 0.6, "logprobs": True, "logprobs_mode": "processed"},
])
def test_a_joiner_gets_its_first_token_in_the_step_it_joins_and_what_it_gets_alone(model_and_tokenizer, request_body):
    model, tokenizer = model_and_tokenizer
    body = {"prompt_token_ids": prompt_ids(3, 21), "max_tokens": 9, "ignore_eos": True, "stream": True,
            **request_body}
    alone = run_all(BatchScheduler(CompiledEngine(model, tokenizer)), {"late": body})["late"]
    scheduler = BatchScheduler(CompiledEngine(model, tokenizer, max_num_seqs=8), max_num_seqs=8)
    for job_id in ("long0", "long1", "long2"):
        assert scheduler.admit(job_id, {"prompt_token_ids": prompt_ids(7, 4), "max_tokens": 60, "temperature": 0,
                                        "ignore_eos": True}) is None
    for _ in range(4):
        scheduler.step()
    assert scheduler.admit("late", body) is None
    steps_to_first = 0
    while not any(d.job_id == "late" and d.token_ids for d in scheduler.take_stream_deltas()):
        scheduler.step()
        steps_to_first += 1
    assert steps_to_first == 1  # the step that admitted it
    joined = run_all(scheduler, {})["late"]
    assert len(joined.choices) == body.get("n", 1)
    for a, b in zip(alone.choices, joined.choices):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
        if a.top_logprobs:
            assert [[t.token_id for t in top] for top in b.top_logprobs] == \
                   [[t.token_id for t in top] for top in a.top_logprobs]


def test_a_joiners_first_token_from_its_prefill_comes_alone_and_the_step_in_flight_stays(model_and_tokenizer,
                                                                                         first_token_from):
    """From the prefill: the joiner's call prefills its whole prompt, returns its first token and
    launches nothing, and the batch's step in flight is read back by the next call. From a step:
    the call prefills all but the last token and reads back the step that samples it, with the
    batch's tokens. A joiner cached but its last token takes a decode step either way. Everything
    is what each request gives alone."""
    from_prefill = first_token_from == "prefill"
    model, tokenizer = model_and_tokenizer
    engine = CompiledEngine(model, tokenizer, max_num_seqs=8, prefix_cache_bytes=1 << 26)
    scheduler = BatchScheduler(engine, max_num_seqs=8)
    body = {"max_tokens": 10, "temperature": 0, "logprobs": True, "ignore_eos": True, "stream": True}
    longs = {f"long{i}": {**body, "prompt_token_ids": prompt_ids(i, 6), "max_tokens": 40} for i in range(3)}
    for job_id, request in longs.items():
        assert scheduler.admit(job_id, request) is None
    for _ in range(4):
        scheduler.step()
    scheduler.take_stream_deltas()
    counters = engine.stats().counters
    joiner = {**body, "prompt_token_ids": prompt_ids(9, 23)}
    assert scheduler.admit("joiner", joiner) is None
    scheduler.step()
    after = engine.stats().counters
    got = {d.job_id for d in scheduler.take_stream_deltas() if d.token_ids}
    assert got == ({"joiner"} if from_prefill else {"joiner", *longs})
    assert after["prefill_tokens"] - counters["prefill_tokens"] == (23 if from_prefill else 22)
    assert after["decode_steps"] - counters["decode_steps"] == (0 if from_prefill else 1)
    scheduler.step()
    got = {d.job_id for d in scheduler.take_stream_deltas() if d.token_ids}
    assert got == (set(longs) if from_prefill else set())  # the step in flight, launched before the joiner / a launch alone
    results = run_all(scheduler, {})
    assert_matches_alone(model, {**longs, "joiner": joiner}, results, set())
    assert scheduler.admit("long", longs["long0"]) is None
    for _ in range(3):
        scheduler.step()
    scheduler.take_stream_deltas()
    counters = engine.stats().counters
    assert scheduler.admit("again", joiner) is None  # its prompt cached but the last token
    scheduler.step()
    after = engine.stats().counters
    assert "again" in {d.job_id for d in scheduler.take_stream_deltas() if d.token_ids}
    assert after["prefill_tokens"] == counters["prefill_tokens"] and after["decode_steps"] > counters["decode_steps"]
    assert run_all(scheduler, {})["again"].choices[0].token_ids == results["joiner"].choices[0].token_ids


def test_past_the_eager_allowance_joiners_get_their_first_token_one_step_later(model_and_tokenizer, first_token_from):
    model, tokenizer = model_and_tokenizer
    engine = CompiledEngine(model, tokenizer, max_num_seqs=16)
    scheduler = BatchScheduler(engine, max_num_seqs=16)
    assert scheduler.admit("long", {"prompt_token_ids": prompt_ids(7, 4), "max_tokens": 80, "ignore_eos": True}) is None
    for _ in range(3):
        scheduler.step()
    first_call = []
    for i in range(compiled.EAGER_MAX + 2):
        assert scheduler.admit(f"j{i}", {"prompt_token_ids": prompt_ids(i, 5), "max_tokens": 20, "temperature": 0,
                                         "ignore_eos": True, "stream": True}) is None
        calls = 0
        while not any(d.job_id == f"j{i}" and d.token_ids for d in scheduler.take_stream_deltas()):
            scheduler.step()
            calls += 1
        first_call.append(calls)
    if first_token_from == "prefill":  # no decode step samples it: every joiner has it at once
        assert first_call == [1] * (compiled.EAGER_MAX + 2)
        return
    assert first_call == [1] * compiled.EAGER_MAX + [2, 2]  # the allowance, then one step later
    for _ in range(compiled.EAGER_REFILL_STEPS):
        scheduler.step()
    assert scheduler.admit("again", {"prompt_token_ids": prompt_ids(9, 5), "max_tokens": 5, "stream": True}) is None
    scheduler.step()
    assert any(d.job_id == "again" and d.token_ids for d in scheduler.take_stream_deltas())  # refilled


def test_both_engines_give_the_same_sampled_ids_and_logprobs_for_seeded_rows(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    requests = {f"s{i}": {"prompt_token_ids": prompt_ids(i, 4 + i % 7), "max_tokens": 10, "seed": 40 + i,
                          "temperature": [0.7, 1.2][i % 2], "top_k": [0, 8][i % 2], "logprobs": True,
                          "top_logprobs": 2, "ignore_eos": True, "frequency_penalty": 0.4 * (i % 3)}
                for i in range(10)}
    batched = run_all(BatchScheduler(TextEngine(model, tokenizer, max_num_seqs=16), max_num_seqs=16), requests)
    mine = run_all(BatchScheduler(CompiledEngine(model, tokenizer, max_num_seqs=16), max_num_seqs=16), requests)
    for job_id in requests:
        a, b = batched[job_id].choices[0], mine[job_id].choices[0]
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)


def test_a_row_whose_processor_fails_ends_alone(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    real = step_sampling.logits_processors

    def failing_for_one(params, prompt_len, capture=None, constraint=None):
        processors = real(params, prompt_len, capture, constraint)
        if params.presence_penalty == 1.25:
            def broken(tokens, logits):
                if tokens.size > prompt_len + 2:
                    raise RuntimeError("boom")
                return logits
            processors.append(broken)
        return processors

    monkeypatch.setattr(step_sampling, "logits_processors", failing_for_one)
    requests = {f"ok{i}": {"prompt_token_ids": prompt_ids(i, 6), "max_tokens": 8, "temperature": 0, "logprobs": True,
                           "ignore_eos": True} for i in range(3)}
    scheduler = BatchScheduler(CompiledEngine(model, tokenizer))
    results = run_all(scheduler, {**requests, "bad": {"prompt_token_ids": prompt_ids(9, 6), "max_tokens": 8,
                                                       "presence_penalty": 1.25, "ignore_eos": True}})
    assert results["bad"].status == "failed" and "boom" in results["bad"].error.message
    assert_matches_alone(model, requests, results, set())
    assert scheduler.engine.num_active == 0


def test_a_follow_up_turn_reuses_the_finished_sequence_from_the_slot_buffers(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    system = prompt_ids(5, 150)
    base = {"max_tokens": 10, "temperature": 0, "logprobs": True, "ignore_eos": True}
    engine = CompiledEngine(model, tokenizer, prefix_cache_bytes=64 << 20)
    scheduler = BatchScheduler(engine)
    first = run_all(scheduler, {"first": {**base, "prompt_token_ids": system}})["first"]
    follow_up = {**base, "prompt_token_ids": system + first.choices[0].token_ids + prompt_ids(6, 8)}
    got = run_all(scheduler, {"second": follow_up})["second"]
    assert engine.prefix_cache_stats()["reused_tokens"] == len(system) + len(first.choices[0].token_ids)
    assert_matches_alone(model, {"second": follow_up}, {"second": got}, set())


def test_warm_up_compiles_every_bucket_so_a_run_compiles_nothing(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = CompiledEngine(model, tokenizer, max_num_seqs=6)
    shapes, _ = engine.warm_up(200)
    assert shapes == len(engine.compiled_shapes) == len([1, 2, 3, 4, 6]) * len([128, 192, 256])
    before = engine.compiled_shapes
    run_all(BatchScheduler(engine, max_num_seqs=6), {
        f"r{i}": {"prompt_token_ids": prompt_ids(i, 10 + 30 * i), "max_tokens": 20, "temperature": 0}
        for i in range(6)})
    assert engine.compiled_shapes == before


def test_buffers_stay_within_the_kv_budget_and_admission_can_count_them(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    per_token = CompiledEngine(model, tokenizer).kv_bytes_per_token
    padded = CompiledEngine(model, tokenizer, max_num_seqs=8)
    assert padded.kv_bytes_for(5, 130) == 6 * 192 * per_token  # both bucketed
    budget = 5 * 192 * per_token
    tight = CompiledEngine(model, tokenizer, max_num_seqs=8, kv_budget_bytes=budget)
    assert tight.kv_bytes_for(5, 130) == 5 * 192 * per_token  # rows exact, length in steps of 64
    scheduler = BatchScheduler(tight, max_num_seqs=8)
    requests = {f"r{i}": {"prompt_token_ids": prompt_ids(i, 100), "max_tokens": 30, "temperature": 0,
                          "logprobs": True, "ignore_eos": True} for i in range(5)}
    for job_id, request in requests.items():
        assert scheduler.admit(job_id, request) is None
    results, largest = {}, 0
    while len(scheduler):
        results.update((ended.id, ended.result()) for ended in scheduler.step())
        largest = max(largest, tight.stats().counters["slot_buffer_bytes"])
    assert 0 < largest <= budget
    assert_matches_alone(model, requests, results, set())


_engines: dict = {}

# tests/test_sampling_properties.py's mix, with sampling settings drawn from a few values: mlx-lm
# compiles its samplers for each float setting, and on a CPU each new one costs a kernel build.
random_request = st.fixed_dictionaries(
    {"prompt_token_ids": st.lists(st.integers(3, 511), min_size=1, max_size=24), "max_tokens": st.integers(1, 12)},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 1.5]),
        "top_p": st.sampled_from([0.3, 0.9]),
        "top_k": st.sampled_from([0, 5]),
        "min_p": st.sampled_from([0.0, 0.1]),
        "repetition_penalty": st.sampled_from([1.0, 1.3]),
        "presence_penalty": st.sampled_from([0.0, 0.5]),
        "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.sampled_from([-100.0, 5.0]), max_size=2),
        "seed": st.integers(0, 2**32),
        "stop": st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
        "n": st.integers(1, 4),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "logprobs_mode": st.sampled_from(["raw", "processed"]),
        "ignore_eos": st.booleans(),
    },
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(random_request, min_size=1, max_size=6))
def test_random_mixes_end_and_account_as_on_mlx_lms_engine(tiny_model_dir, batch):
    if "engine" not in _engines:  # one engine for every example, as a worker keeps one
        _engines["engine"] = CompiledEngine(*load(tiny_model_dir), max_num_seqs=64)
    scheduler = BatchScheduler(_engines["engine"], max_num_seqs=64)
    results = run_all(scheduler, {f"j{i}": r for i, r in enumerate(batch)})
    for i, request in enumerate(batch):
        result = results[f"j{i}"]
        assert result.status == "finished", result.error
        assert len(result.choices) == request.get("n", 1)
        for choice in result.choices:
            assert 1 <= len(choice.token_ids) <= request["max_tokens"]
            assert result.usage.prompt_tokens == len(request["prompt_token_ids"])
            if request.get("logprobs") or request.get("top_logprobs"):
                assert len(choice.logprobs) == len(choice.token_ids)
    assert scheduler.engine.num_active == 0


# --- architectures and the fallback ------------------------------------------------------------
COVERED = [("llama", None), ("mistral", None), ("qwen2", None), ("qwen3", None), ("gemma", 1), ("gemma2", None),
           ("gemma2", 4)]


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    made: dict = {}

    def build(arch: str, kv_heads=None) -> str:
        key = (arch, kv_heads)
        if key not in made:
            made[key] = str(make_tiny_model(tmp_path_factory.mktemp(f"{arch}-{kv_heads}"), arch=arch,
                                            num_key_value_heads=kv_heads))
        return made[key]

    return build


@pytest.mark.parametrize("arch, kv_heads", COVERED, ids=[f"{a}-kv{k or 2}" for a, k in COVERED])
def test_each_covered_architecture_decodes_compiled_and_matches_alone(arch_dir, arch, kv_heads):
    model, tokenizer = load(arch_dir(arch, kv_heads))
    path = choose_decode_path(model, "auto")
    assert path.name == "compiled", path.reason
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4)
    scheduler = BatchScheduler(engine, max_num_seqs=4)
    requests = {f"r{i}": {"prompt_token_ids": prompt_ids(i, n), "max_tokens": m, "temperature": 0, "logprobs": True,
                          "ignore_eos": True} for i, (n, m) in enumerate([(5, 8), (13, 6), (2, 9), (30, 5), (8, 7)])}
    results = {}
    for job_id, request in requests.items():  # one a step: joiners, and a fifth once a slot frees up
        assert scheduler.admit(job_id, request) is None
        results.update((ended.id, ended.result()) for ended in scheduler.step())
    results.update(run_all(scheduler, {}))
    assert_matches_alone(model, requests, results, set())


def test_a_sliding_window_model_falls_back_to_mlx_lm_and_the_worker_says_why(arch_dir, caplog):
    from worker.loading import build_engine
    from worker.settings import WorkerSettings

    path = arch_dir("gemma3_text")
    model, _ = load(path)
    chosen = choose_decode_path(model, "auto")
    assert chosen.name == "batch-generator" and "RotatingKVCache" in chosen.reason
    with pytest.raises(ValueError, match="MLXQ_DECODE=compiled.*RotatingKVCache"):
        choose_decode_path(model, "compiled")
    with caplog.at_level(logging.INFO, logger="mlxq.worker"):
        engine = build_engine(WorkerSettings.from_env({}, model=path))
    assert isinstance(engine, TextEngine)
    assert any("decode path: batch-generator" in r.message and "RotatingKVCache" in r.message for r in caplog.records)
    result = run_all(BatchScheduler(engine), {"r": {"prompt_token_ids": prompt_ids(1, 20), "max_tokens": 4}})["r"]
    assert result.status == "finished"


def test_the_setting_picks_the_engine_and_the_worker_logs_path_and_warm_up(tiny_model_dir, caplog):
    from worker.loading import build_engine
    from worker.settings import WorkerSettings

    with caplog.at_level(logging.INFO, logger="mlxq.worker"):
        auto = build_engine(WorkerSettings.from_env({"MLXQ_DECODE_WARMUP_TOKENS": "128", "MLXQ_DECODE_WARMUP": "blocking"},
                                                    model=tiny_model_dir, max_num_seqs=4))
    assert isinstance(auto, CompiledEngine) and len(auto.compiled_shapes) == len([1, 2, 3, 4])
    messages = [r.message for r in caplog.records]
    assert any(m.startswith("decode path: compiled (llama") for m in messages)
    assert any(m.startswith("decode step warm-up: 4 shapes") for m in messages)
    forced = build_engine(WorkerSettings.from_env({"MLXQ_DECODE": "batch-generator"}, model=tiny_model_dir))
    assert isinstance(forced, TextEngine)
    with pytest.raises(ValueError, match="MLXQ_DECODE"):
        WorkerSettings.from_env({"MLXQ_DECODE": "fast"})
