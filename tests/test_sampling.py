"""Per-request sampling inside one batch, on the tiny real model, checked against references
computed from the model's own distribution (teacher forcing), not against copied numbers. The
tests that do not depend on how an engine schedules its prefills run on both text engines: mlx-lm's
BatchGenerator (TextEngine) and mlxq's compiled decode path (CompiledEngine)."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from tests.reference import greedy_alone, log_softmax, run_all, teacher_forced_logits, teacher_forced_logprobs
from worker.engines import sampling
from worker.engines.base import SamplingParams
from worker.engines.compiled import CompiledEngine
from worker.engines.text import TextEngine
from worker.engines.sampling import SeededSampler, mix_seed, truncate
from worker.scheduler import BatchScheduler

PROMPT = [17, 93, 201, 44, 5, 388, 120]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load(tiny_model_dir)


@pytest.fixture(params=[TextEngine, CompiledEngine, partial(CompiledEngine, first_token_from_prefill=True)],
                ids=["batch-generator", "compiled", "compiled-first-token-from-the-prefill"])
def engine_class(request):
    return request.param


@pytest.fixture
def scheduler(model_and_tokenizer, engine_class):
    model, tokenizer = model_and_tokenizer
    return BatchScheduler(engine_class(model, tokenizer, max_num_seqs=48), max_num_seqs=48)


def ids(result, i=0):
    return result.choices[i].token_ids


def test_greedy_rows_stay_exact_beside_hot_rows(scheduler, model_and_tokenizer):
    model, _ = model_and_tokenizer
    requests = {}
    for i in range(12):
        prompt = [(i * 53 + k * 19) % 500 + 3 for k in range(4 + i)]
        if i % 3 == 0:
            requests[f"greedy{i}"] = {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 0,
                                      "ignore_eos": True, "logprobs": True}
        else:
            requests[f"hot{i}"] = {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 2.0,
                                   "top_p": 0.9, "presence_penalty": 1.5, "ignore_eos": True,
                                   **({"seed": i} if i % 2 else {})}
    results = run_all(scheduler, requests)
    for job_id, request in requests.items():
        if job_id.startswith("greedy"):
            tokens, logprobs = greedy_alone(model, request["prompt_token_ids"], 16, set())
            assert ids(results[job_id]) == tokens
            assert results[job_id].choices[0].logprobs == pytest.approx(logprobs, abs=1e-3)


def allowed_top_k(row: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-row)[:k].tolist())


def allowed_top_p(row: np.ndarray, p: float) -> set[int]:
    order = np.argsort(-row)
    cumulative = np.cumsum(np.exp(row[order]))
    cut = int(np.searchsorted(cumulative, p - 1e-6)) + 1
    return set(order[: cut + 1].tolist())  # one extra for float ties at the boundary


def allowed_min_p(row: np.ndarray, min_p: float) -> set[int]:
    return set(np.nonzero(row >= row.max() + np.log(min_p) - 1e-5)[0].tolist())


@pytest.mark.parametrize("field, value, allowed", [
    ("top_k", 3, allowed_top_k),
    ("top_p", 0.05, allowed_top_p),
    ("min_p", 0.9, allowed_min_p),
])
def test_each_row_samples_only_from_its_own_allowed_set(scheduler, model_and_tokenizer, field, value, allowed):
    model, _ = model_and_tokenizer
    restricted = {f"r{i}": {"prompt_token_ids": PROMPT[i:] + [i + 3], "max_tokens": 24, "temperature": 2.0,
                            field: value, "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
                  for i in range(4)}
    free = {f"f{i}": {"prompt_token_ids": PROMPT[i:] + [i + 3], "max_tokens": 24, "temperature": 2.0,
                      "ignore_eos": True} for i in range(4)}
    results = run_all(scheduler, {**restricted, **free})
    outside_free = 0
    for i in range(4):
        prompt = PROMPT[i:] + [i + 3]
        choice = results[f"r{i}"].choices[0]
        reference = teacher_forced_logprobs(model, prompt, choice.token_ids)
        for j, token in enumerate(choice.token_ids):
            assert token in allowed(reference[j], value), (field, j, token)
        # raw logprobs and top_logprobs are the reference log-softmax
        assert choice.logprobs == pytest.approx([reference[j][t] for j, t in enumerate(choice.token_ids)], abs=1e-3)
        for j, top in enumerate(choice.top_logprobs):
            assert [t.token_id for t in top] == np.argsort(-reference[j])[:5].tolist()
            assert [t.logprob for t in top] == pytest.approx(np.sort(reference[j])[::-1][:5].tolist(), abs=1e-3)
        free_tokens = results[f"f{i}"].choices[0].token_ids
        free_reference = teacher_forced_logprobs(model, prompt, free_tokens)
        outside_free += sum(t not in allowed(free_reference[j], value) for j, t in enumerate(free_tokens))
    assert outside_free > 0, "the unrestricted neighbours should stray outside the set: the filter was per row"


def test_logit_bias_forces_and_bans(scheduler, model_and_tokenizer):
    model, _ = model_and_tokenizer
    plain, _ = greedy_alone(model, PROMPT, 12, set())
    favourite = max(set(plain), key=plain.count)
    results = run_all(scheduler, {
        "force": {"prompt_token_ids": PROMPT, "max_tokens": 12, "temperature": 1.0, "logit_bias": {"77": 100},
                  "ignore_eos": True},
        "ban": {"prompt_token_ids": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": {str(favourite): -100},
                "ignore_eos": True},
        "plain": {"prompt_token_ids": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    })
    assert ids(results["force"]) == [77] * 12
    assert favourite not in ids(results["ban"])
    assert ids(results["plain"]) == plain


def reference_penalized_greedy(model, prompt, generated, presence=0.0, frequency=0.0, repetition=1.0):
    """What each greedy token must be under the penalty definitions (see worker/engines/sampling.py)."""
    raw = teacher_forced_logits(model, prompt, generated)
    expected, processed = [], []
    for j in range(len(generated)):
        logits = raw[j].copy()
        counts = np.bincount(generated[:j], minlength=logits.shape[0]).astype(np.float32)
        seen = np.bincount(prompt + generated[:j], minlength=logits.shape[0]) > 0
        logits = np.where(seen, np.where(logits < 0, logits * repetition, logits / repetition), logits)
        logits = logits - counts * frequency - (counts > 0) * presence
        expected.append(int(np.argmax(logits)))
        processed.append(log_softmax(logits))
    return expected, processed


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                     {"repetition_penalty": 1.8}])
def test_penalties_change_what_the_reference_says(scheduler, model_and_tokenizer, penalty):
    model, _ = model_and_tokenizer
    requests = {
        "raw": {"prompt_token_ids": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "logprobs": True, **penalty},
        "processed": {"prompt_token_ids": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                      "logprobs": True, "logprobs_mode": "processed", **penalty},
    }
    results = run_all(scheduler, requests)
    plain, _ = greedy_alone(model, PROMPT, 20, set())
    tokens = ids(results["raw"])
    assert tokens == ids(results["processed"])
    assert tokens != plain, "the penalty should change this repetitive model's output"
    expected, processed = reference_penalized_greedy(
        model, PROMPT, tokens, penalty.get("presence_penalty", 0.0), penalty.get("frequency_penalty", 0.0),
        penalty.get("repetition_penalty", 1.0))
    assert tokens == expected
    raw = teacher_forced_logprobs(model, PROMPT, tokens)
    assert results["raw"].choices[0].logprobs == pytest.approx([raw[j][t] for j, t in enumerate(tokens)], abs=1e-3)
    assert results["processed"].choices[0].logprobs == pytest.approx(
        [processed[j][t] for j, t in enumerate(tokens)], abs=1e-3)


def test_processed_logprobs_include_temperature_and_truncation(scheduler, model_and_tokenizer):
    model, _ = model_and_tokenizer
    request = {"prompt_token_ids": PROMPT, "max_tokens": 10, "temperature": 0.7, "top_k": 4, "seed": 5,
               "ignore_eos": True, "logprobs": True, "logprobs_mode": "processed"}
    choice = run_all(scheduler, {"p": request})["p"].choices[0]
    raw = teacher_forced_logprobs(model, PROMPT, choice.token_ids)
    for j, token in enumerate(choice.token_ids):
        keep = np.argsort(-raw[j])[:4]
        scaled = raw[j][keep] / 0.7
        expected = log_softmax(scaled)
        assert choice.logprobs[j] == pytest.approx(float(expected[list(keep).index(token)]), abs=1e-3)


@pytest.mark.parametrize("seeded", [True, False])
def test_the_three_distributions_side_by_side_on_one_sampled_row(scheduler, model_and_tokenizer, seeded):
    """raw: the model's own; scaled: at the temperature, untruncated (what RL trainers recompute);
    processed: exactly what sampled the token (mlx-lm's top-p filter, as its sampler applies it, then
    the temperature, renormalised), in float32."""
    model, _ = model_and_tokenizer
    base = {"prompt_token_ids": PROMPT, "max_tokens": 10, "temperature": 0.6, "top_p": 0.8, "ignore_eos": True,
            "logprobs": True, **({"seed": 9} if seeded else {})}
    results = run_all(scheduler, {mode: {**base, "logprobs_mode": mode} for mode in ("raw", "scaled", "processed")})
    if seeded:  # the same tokens in each mode: the mode changes what is reported, not what is sampled
        assert ids(results["raw"]) == ids(results["scaled"]) == ids(results["processed"])
    for mode, result in results.items():
        tokens = ids(result)
        raw = teacher_forced_logprobs(model, PROMPT, tokens)
        for j, token in enumerate(tokens):
            if mode == "raw":
                expected = raw[j][token]
            elif mode == "scaled":
                expected = log_softmax(raw[j] / 0.6)[token]
            else:
                filtered = np.array(truncate(mx.array(raw[j])[None], SamplingParams(top_p=0.8)))[0]
                expected = log_softmax(filtered / 0.6)[token]
            assert result.choices[0].logprobs[j] == pytest.approx(float(expected), abs=1e-4), (mode, j)


SEEDED = {"prompt_token_ids": PROMPT, "max_tokens": 24, "temperature": 1.3, "top_p": 0.95, "seed": 1234,
          "ignore_eos": True}


def test_seeded_request_gives_the_same_ids_alone_and_in_a_crowd(scheduler, model_and_tokenizer, engine_class):
    alone = ids(run_all(scheduler, {"alone": SEEDED})["alone"])
    crowd = {f"s{i}": {"prompt_token_ids": [(i * 7 + k) % 500 + 3 for k in range(3 + i % 9)], "max_tokens": 30,
                       "temperature": [0, 0.8, 1.5][i % 3], "top_k": i % 5, **({"seed": i} if i % 2 else {}),
                       "repetition_penalty": 1.0 + (i % 4) / 10}
             for i in range(31)}
    results = run_all(scheduler, {**crowd, "target": SEEDED})
    assert ids(results["target"]) == alone
    model, tokenizer = model_and_tokenizer
    fresh = BatchScheduler(engine_class(model, tokenizer))  # a new engine: nothing carried over
    assert ids(run_all(fresh, {"again": SEEDED})["again"]) == alone
    other_seed = ids(run_all(fresh, {"other": {**SEEDED, "seed": 4321}})["other"])
    assert other_seed != alone


def seeded_crowd(count: int) -> dict[str, dict]:
    """Seeded requests only, with settings that differ row to row."""
    return {f"s{i}": {"prompt_token_ids": [(i * 11 + k) % 500 + 3 for k in range(4 + i % 7)], "max_tokens": 12,
                      "temperature": [0.7, 1.0, 1.6][i % 3], "seed": 100 + i, "ignore_eos": True,
                      **[{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.05}][i % 4]}
            for i in range(count)}


def test_a_batch_of_seeded_rows_is_sampled_in_one_call_and_each_row_as_alone(model_and_tokenizer, monkeypatch,
                                                                               engine_class):
    model, tokenizer = model_and_tokenizer
    requests = seeded_crowd(12)
    alone = {job_id: ids(run_all(BatchScheduler(engine_class(model, tokenizer)), {job_id: r})[job_id])
             for job_id, r in requests.items()}
    rows_per_call: list[int] = []
    sample = SeededSampler.__call__

    def counting(self, logprobs):
        rows_per_call.append(logprobs.shape[0])
        return sample(self, logprobs)

    monkeypatch.setattr(SeededSampler, "__call__", counting)
    together = run_all(BatchScheduler(engine_class(model, tokenizer, max_num_seqs=16), max_num_seqs=16), requests)
    assert {job_id: ids(result) for job_id, result in together.items()} == alone
    assert max(rows_per_call) == 12, "the decode steps of 12 seeded rows should sample them in one call"


# 24 seeded rows, each temperature with each filter
MIXED_SEEDED = [SamplingParams(temperature=[0.5, 1.0, 1.7][i % 3], seed=7 + i,
                               **[{}, {"top_k": 4}, {"top_p": 0.6}, {"min_p": 0.1}][i % 4]) for i in range(24)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_seeded_sampler_draws_what_mlx_categorical_draws_for_each_row_alone(dtype):
    """The batched draw against MLX's own per-row sampler (what mlxq called before batching)."""
    vocab, settings = 300, MIXED_SEEDED
    logits = mx.random.normal((len(settings), vocab), key=mx.random.key(3)) * 3
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nothing_left = (mx.arange(len(settings)) == 5)[:, None]  # a row of -inf: uniform over all
    logprobs = mx.where(nothing_left, -mx.inf, logprobs).astype(dtype)
    for step in range(3):
        sampler = SeededSampler()
        sampler.begin()
        for choice, params in enumerate(settings):
            sampler.name_row(params, choice)(mx.array([]), logprobs[choice:choice + 1])
        for _ in range(step):  # later tokens of the same rows: the key moves on with each draw
            for row in sampler._names.pending:
                row.next_key()
        batched = sampler(logprobs).tolist()
        alone = [mx.random.categorical(truncate(logprobs[i:i + 1], p) * (1.0 / p.temperature),
                                       key=mx.random.key(mix_seed(p.seed, i, step))).item()
                 for i, p in enumerate(settings)]
        assert batched == alone


@pytest.mark.parametrize("through_power", [False, True])
def test_exp_is_e_to_the_x_either_way(monkeypatch, through_power):
    monkeypatch.setattr(sampling, "exp_through_power", lambda cpu: through_power)
    x = mx.concatenate([mx.linspace(-87, 10, 2001), mx.array([-mx.inf, 0.0])])
    got = np.array(sampling.exp(x))
    assert got[-2:].tolist() == [0.0, 1.0]
    np.testing.assert_allclose(got[:-2], np.exp(np.array(x[:-2], dtype=np.float64)), rtol=4e-6)


def test_seeded_draws_are_the_same_from_logits_as_from_logprobs():
    """The step sampler gives seeded rows their logits, sparing the log-softmax: a draw must not
    depend on a row's constant, and rows with top-p are normalised by the sampler itself. (In
    bfloat16 the log-softmax rounds each row anew, so there the logits are the truer input.)"""
    vocab, settings = 300, MIXED_SEEDED
    logits = mx.random.normal((len(settings), vocab), key=mx.random.key(5)) * 3 + 90  # e**x overflows
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for step in range(4):
        keys = [mix_seed(p.seed, i, step) for i, p in enumerate(settings)]
        assert (sampling.draw_with_keys(logits, settings, keys).tolist()
                == sampling.draw_with_keys(logprobs, settings, keys).tolist())


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(temperature=1.0, min_p=0.2),
                                    SamplingParams(temperature=1.0, top_p=0.95)],
                         ids=["temperature", "top_k", "min_p", "top_p"])
def test_only_samplers_that_read_probabilities_are_given_them(params):
    """mlx-lm's sampler for `params` draws the same from logits as from log-probabilities unless
    `reads_probabilities` says it must have the latter (top-p's sums overflow from logits near 100)."""
    logits = mx.random.normal((64, 40), key=mx.random.key(2)) * 2 + 90
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p if params.top_p < 1.0 else 0.0,
                           min_p=params.min_p, top_k=params.top_k)
    drawn = []
    for scores in (logits, logprobs):
        mx.random.seed(11)
        drawn.append(sampler(scores).tolist())
    assert (drawn[0] == drawn[1]) is not sampling.reads_probabilities(params)


def test_unseeded_requests_are_random(scheduler):
    request = {k: v for k, v in SEEDED.items() if k != "seed"}
    results = run_all(scheduler, {"a": request, "b": request, "c": request})
    assert len({tuple(ids(r)) for r in results.values()}) > 1


def test_stop_strings_that_straddle_tokens(scheduler, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    base = {"prompt_token_ids": PROMPT, "max_tokens": 30, "temperature": 1.0, "seed": 99, "ignore_eos": True}
    full = run_all(scheduler, {"full": base})["full"].choices[0]
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    # a boundary between two tokens whose texts are clean and not empty
    j = next(j for j in range(3, len(pieces) - 1)
             if pieces[j] and pieces[j + 1] and "\ufffd" not in pieces[j] + pieces[j + 1]
             and tokenizer.decode(full.token_ids[: j + 2]) == "".join(pieces[: j + 2]))
    stop = pieces[j][-1] + pieces[j + 1][:1]
    cut = full.text.find(stop)
    assert 0 <= cut
    result = run_all(scheduler, {"stopped": {**base, "stop": ["never-appears", stop]}})["stopped"]
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full.text[:cut] and stop not in choice.text
    # token_ids are every sampled token, through the one that completed the stop string
    assert choice.token_ids == full.token_ids[: len(choice.token_ids)]
    assert tokenizer.decode(choice.token_ids).find(stop) == cut
    assert stop not in tokenizer.decode(choice.token_ids[:-1])
    assert result.usage.completion_tokens == len(choice.token_ids)


class CountingModel:
    """Counts the prompt tokens the model is run on (calls with more than one position)."""

    def __init__(self, model) -> None:
        self._model = model
        self.prefill_tokens = 0

    def __call__(self, inputs, *args, **kwargs):
        if inputs.shape[1] > 1:
            self.prefill_tokens += inputs.shape[1] * inputs.shape[0]
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_n_choices_share_one_prefill(model_and_tokenizer, engine_class):
    model, tokenizer = model_and_tokenizer
    prompt = [(k * 29) % 500 + 3 for k in range(40)]
    counting = CountingModel(model)
    scheduler = BatchScheduler(engine_class(counting, tokenizer))
    greedy = run_all(scheduler, {"g": {"prompt_token_ids": prompt, "max_tokens": 8, "n": 4, "temperature": 0,
                                       "ignore_eos": True, "logprobs": True}})["g"]
    assert counting.prefill_tokens == len(prompt) - 1  # once, not 4 times
    reference, reference_logprobs = greedy_alone(model, prompt, 8, set())
    assert [c.token_ids for c in greedy.choices] == [reference] * 4
    for choice in greedy.choices:
        assert choice.logprobs == pytest.approx(reference_logprobs, abs=1e-3)
    assert greedy.usage.prompt_tokens == len(prompt) and greedy.usage.completion_tokens == 32

    counting.prefill_tokens = 0
    sampled = run_all(scheduler, {"s": {"prompt_token_ids": prompt, "max_tokens": 8, "n": 4, "temperature": 1.5,
                                        "seed": 3, "ignore_eos": True}})["s"]
    assert counting.prefill_tokens == len(prompt) - 1
    assert len({tuple(c.token_ids) for c in sampled.choices}) == 4
    separately = run_all(scheduler, {f"x{i}": {"prompt_token_ids": prompt, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True} for i in range(4)})
    assert len(separately) == 4


def test_choices_prefilled_here_enter_the_batch_together_and_prompts_a_prefill_batch_at_a_time(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = TextEngine(model, tokenizer, max_num_seqs=32, prefill_batch_size=2)
    scheduler = BatchScheduler(engine, max_num_seqs=32)
    requests = {f"r{i}": {"prompt_token_ids": [(i * 13 + k) % 500 + 3 for k in range(12)], "max_tokens": 6, "n": 4,
                          "temperature": 0.8, "seed": i, "ignore_eos": True} for i in range(8)}
    results = run_all(scheduler, requests)
    assert all(len(choice.token_ids) == 6 for result in results.values() for choice in result.choices)
    # Each request's prompt is prefilled here and its first tokens sampled from it; its 4 rows then
    # start from that cache, and all 32 rows enter mlx-lm's batch together: 5 decode steps, not the
    # 16 more it took while mlx-lm let in a prefill batch (2) of them a step.
    assert engine.time_stats()["decode_steps"] <= 6

    before = engine.time_stats()
    singles = {f"s{i}": {"prompt_token_ids": [(i * 17 + k) % 500 + 3 for k in range(12)], "max_tokens": 3,
                         "temperature": 0, "ignore_eos": True} for i in range(8)}
    run_all(scheduler, singles)
    after = engine.time_stats()
    assert after["prefill_calls"] - before["prefill_calls"] == 4, "8 prompts, a prefill batch of 2 at a time"
    assert after["own_prefills"] == before["own_prefills"]


def _prefilled_tokens_when_first_token(model_and_tokenizer, monkeypatch, hold: bool) -> tuple[list[int], int]:
    """Four prompts, two a prefill batch, with the pacing rule forced to `hold`: for each request,
    the prompt tokens prefilled when its first token came out, and the total."""
    model, tokenizer = model_and_tokenizer
    engine = TextEngine(model, tokenizer, max_num_seqs=32, prefill_batch_size=2)
    monkeypatch.setattr(engine._waiting.pacing, "hold_for_first_tokens", lambda waiting_batches: hold)
    scheduler = BatchScheduler(engine, max_num_seqs=32)
    prefilled_when_first_token = {}
    real_step = engine.step

    def recording_step():
        events = real_step()
        for event in events:
            prefilled_when_first_token.setdefault(event.uid, engine.time_stats()["prefill_tokens"])
        return events

    monkeypatch.setattr(engine, "step", recording_step)
    requests = {f"r{i}": {"prompt_token_ids": [(i * 29 + k) % 500 + 3 for k in range(12)], "max_tokens": 4,
                          "temperature": 0, "ignore_eos": True} for i in range(4)}
    run_all(scheduler, requests)
    return sorted(prefilled_when_first_token.values()), engine.time_stats()["prefill_tokens"]


def test_held_a_prefill_batchs_first_tokens_come_out_before_the_next_batch_is_prefilled(model_and_tokenizer,
                                                                                         monkeypatch):
    seen, total = _prefilled_tokens_when_first_token(model_and_tokenizer, monkeypatch, hold=True)
    first_batch, _, second_batch, _ = seen
    # The first two have their first tokens while only their own prompts have been prefilled; the
    # call that would have returned them also prefilled the next two.
    assert seen == [first_batch, first_batch, second_batch, second_batch]
    assert 0 < first_batch < second_batch == total


def test_unheld_the_next_batch_is_prefilled_in_the_call_that_returns_the_first_tokens(model_and_tokenizer,
                                                                                      monkeypatch):
    seen, total = _prefilled_tokens_when_first_token(model_and_tokenizer, monkeypatch, hold=False)
    assert seen == [total] * 4  # the second batch got in a call sooner, the first batch's tokens after it


def test_return_prompt_token_ids(scheduler, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    result = run_all(scheduler, {"p": {"prompt": "hello world", "max_tokens": 2, "return_prompt_token_ids": True}})["p"]
    assert result.prompt_token_ids == list(tokenizer.encode("hello world"))
    assert result.usage.prompt_tokens == len(result.prompt_token_ids)
    assert run_all(scheduler, {"q": {"prompt": "hello world", "max_tokens": 2}})["q"].prompt_token_ids is None
