"""Speculative decoding on the compiled engine (worker/engines/speculation/, docs/speculative.md), on
tiny random models: every row gives the tokens and logprobs it gives without speculation (greedy and
seeded rows exactly, alone or in any batch), sampled rows keep the model's distribution (a
chi-square test), and stop tokens, stop strings, max_tokens, opt-outs, refused features,
cancellation and weight swaps keep working. The references are the same engine without a
speculator, mlx-lm's `generate_step` alone, and the model's exact distribution."""

from __future__ import annotations

import io
import logging
import os
import time
from typing import Any, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import worker  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
from mlx_lm import load

from tests.reference import greedy_alone, log_softmax, run_all, teacher_forced_logits
from worker.engines.compiled import CompiledEngine
from worker.engines.kernel_prebuild import KernelPrebuild, prebuild
from worker.engines.slot_cache import KVLayout, SlotBuffers
from worker.engines.speculation import DraftRow, GradedSpeculator, speculator_for
from worker.engines.speculation.adaptive import FIRST_BACKOFF, MAX_BACKOFF, RowAdaptivity
from worker.engines.speculation.pass_cost import FORGET_AFTER
from worker.engines.speculation.draft_model import DraftModelDrafter, VocabularyMismatch, check_same_vocabulary
from worker.engines.speculation.ngram import NgramDrafter
from worker.scheduler import BatchScheduler
from worker.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load(tiny_model_dir)


@pytest.fixture(scope="module")
def itself(tiny_model_dir):
    """The served model's weights in a model object of their own: the model as its own draft (the ceiling)."""
    return load(tiny_model_dir)[0]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> str:
    """An unrelated tiny random model with the same tokenizer (other weights): the floor of a draft."""
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-draft", seed=7))


@pytest.fixture(scope="module")
def unrelated(other_dir):
    return load(other_dir)[0]


def looping_prompt(i: int, length: int) -> list[int]:
    """A prompt that repeats a short phrase, so prompt lookup has something to find."""
    phrase = [(i * 37 + k * 11) % 500 + 3 for k in range(5 + i % 3)]
    return (phrase * (length // len(phrase) + 1))[:length]


def drafter_for(name: str, model: Any, itself: Any, unrelated: Any) -> Any:
    vocab = model.args.vocab_size
    if name == "ngram":
        return NgramDrafter()
    return DraftModelDrafter(itself if name == "itself" else unrelated, vocab)


def run(model, tokenizer, requests: dict[str, dict], speculator=None, max_num_seqs: int = 8,
        first_token_from_prefill: bool = False) -> tuple[dict, Any]:
    engine = CompiledEngine(model, tokenizer, max_num_seqs=max_num_seqs, speculator=speculator,
                            first_token_from_prefill=first_token_from_prefill)
    results = run_all(BatchScheduler(engine, max_num_seqs=max_num_seqs), dict(requests))
    return results, engine


def assert_same(with_spec: dict, without: dict, tolerance: float = 1e-4) -> None:
    for job_id, reference in without.items():
        got = with_spec[job_id]
        assert got.status == reference.status == "finished", (job_id, got.error)
        for mine, theirs in zip(got.choices, reference.choices, strict=True):
            assert mine.token_ids == theirs.token_ids, job_id
            assert mine.text == theirs.text and mine.finish_reason == theirs.finish_reason, job_id
            if theirs.logprobs is not None:
                assert mine.logprobs == pytest.approx(theirs.logprobs, abs=tolerance), job_id
            if theirs.top_logprobs is not None:
                for a, b in zip(mine.top_logprobs, theirs.top_logprobs, strict=True):
                    assert [t.token_id for t in a] == [t.token_id for t in b], job_id
                    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=tolerance), job_id


def accepted(results: dict) -> int:
    return sum(r.speculation.accepted for r in results.values() if r.speculation is not None)


GREEDY_BATCH = {
    **{f"g{i}": {"prompt_token_ids": looping_prompt(i, 20 + 7 * i), "max_tokens": 24 + 3 * i, "temperature": 0,
                 "logprobs": True, "top_logprobs": 2, "ignore_eos": True} for i in range(4)},
    "processed": {"prompt_token_ids": looping_prompt(5, 30), "max_tokens": 20, "temperature": 0, "logprobs": True,
                  "logprobs_mode": "processed", "ignore_eos": True},
    "bias": {"prompt_token_ids": looping_prompt(6, 25), "max_tokens": 20, "temperature": 0, "logprobs": True,
             "logit_bias": {"40": 3.0, "41": -5.0}, "ignore_eos": True},
    "eos": {"prompt_token_ids": looping_prompt(7, 12), "max_tokens": 30, "temperature": 0, "logprobs": True},
}


@pytest.mark.parametrize("drafter,from_prefill", [("ngram", False), ("itself", False), ("unrelated", False),
                                                  ("itself", True)])
def test_greedy_rows_give_their_tokens_and_logprobs_without_speculation(target, itself, unrelated, drafter,
                                                                        from_prefill):
    """In one batch, greedy rows (raw and processed logprobs with top entries, a logit bias, a row
    that may end at EOS) give what the engine gives without speculation and what mlx-lm gives each
    alone, logprobs within 1e-4; the proposals were used (the model as its own draft: each accepted
    whole, but where a logit bias changes the served model's choice). With `from_prefill` each row's
    first token comes from its prefill's logits (a GPU's way) rather than a decode step (the CPU's)."""
    model, tokenizer = target
    without, _ = run(model, tokenizer, GREEDY_BATCH)
    with_spec, engine = run(model, tokenizer, GREEDY_BATCH, speculator_for(drafter_for(drafter, model, itself, unrelated)),
                            first_token_from_prefill=from_prefill)
    assert_same(with_spec, without)
    eos = set(tokenizer.eos_token_ids)
    for job_id in ("g0", "g3", "eos"):
        request = GREEDY_BATCH[job_id]
        tokens, logprobs = greedy_alone(model, request["prompt_token_ids"], request["max_tokens"],
                                        set() if request.get("ignore_eos") else eos)
        assert with_spec[job_id].choices[0].token_ids == tokens
        assert with_spec[job_id].choices[0].logprobs == pytest.approx(logprobs, abs=1e-3)
    for job_id, request in GREEDY_BATCH.items():
        if request.get("ignore_eos"):  # max_tokens is never passed, however many proposed tokens were accepted
            assert len(with_spec[job_id].choices[0].token_ids) == request["max_tokens"]
    assert accepted(with_spec) > 0
    counters = engine.stats().counters
    assert counters["speculative_accepted"] >= accepted(with_spec) and counters["speculative_steps"] > 0
    if drafter == "itself":
        assert all(r.speculation.accepted == r.speculation.proposed for job_id, r in with_spec.items()
                   if job_id != "bias")  # (the draft model knows nothing of the row's logit bias)
        longest = max(len(r.choices[0].token_ids) for r in with_spec.values())
        assert counters["decode_steps"] <= longest * 2 // 3  # several tokens a forward pass


def seeded_requests() -> dict[str, dict]:
    return {f"s{i}": {"prompt_token_ids": looping_prompt(i, 14 + 5 * i), "max_tokens": 18, "temperature": 0.5 + 0.1 * i,
                      "top_p": 0.95 if i % 2 else 1.0, "top_k": 40 if i == 2 else 0, "seed": 100 + i,
                      "n": 2 if i == 1 else 1, "logprobs": True, "ignore_eos": True} for i in range(4)}


def test_seeded_rows_are_the_same_alone_in_a_batch_and_without_speculation(target, itself):
    """Seeded rows (temperatures, top-p, top-k, two choices) give the same tokens and logprobs
    alone and batched with speculation as without it, while proposals are both accepted and rejected."""
    model, tokenizer = target
    requests = seeded_requests()
    without, _ = run(model, tokenizer, requests)
    batched, _ = run(model, tokenizer, requests, speculator_for(DraftModelDrafter(itself, model.args.vocab_size)),
                     first_token_from_prefill=True)
    assert_same(batched, without)
    for job_id, request in requests.items():
        alone, _ = run(model, tokenizer, {job_id: request},
                       speculator_for(DraftModelDrafter(itself, model.args.vocab_size), max_k=2))
        assert_same(alone, {job_id: without[job_id]})
    stats = [r.speculation for r in batched.values()]
    assert sum(s.accepted for s in stats) > 0 and sum(s.proposed - s.accepted for s in stats) > 0


class FixedDrafter:
    """Proposes the same tokens whatever the row holds (deterministic, as verification requires)."""

    name = "ngram"
    judged_as_a_whole = False
    guesses_first_token = True  # it proposes at every step, the first one included
    graded = False  # its rows' own acceptance decides (adaptive.py)
    kv_bytes_per_token = 0

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def share_kv_budget(self, budget_bytes: int) -> None:
        pass

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        return [self.tokens[: row.k] for row in rows]

    def grade(self, uid: str) -> int:
        return 0

    def accepted(self, uid: str, proposed: int, accepted: int) -> None:
        pass

    def forget(self, uid: str) -> None:
        pass

    def reset(self) -> None:
        pass


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_rows_keep_the_models_distribution(target, seeded):
    """400 rows sample two tokens from a 4-token vocabulary (a +100 logit bias on 4 ids) while a
    drafter proposes two fixed tokens at every step: the pairs' counts fit the model's exact joint
    distribution p(t0) p(t1 | t0) (chi-square). Fixed seeds (and MLX's global seed for unseeded
    rows) make it deterministic."""
    model, tokenizer = target
    prompt = looping_prompt(9, 16)
    small = [40, 77, 123, 301]
    bias = {str(t): 100.0 for t in small}
    rows = 400
    requests = {f"r{i}": {"prompt_token_ids": prompt, "max_tokens": 2, "temperature": 1.0, "logit_bias": bias,
                          "ignore_eos": True, **({"seed": i} if seeded else {})} for i in range(rows)}
    mx.random.seed(1234)
    results, engine = run(model, tokenizer, requests, speculator_for(FixedDrafter([small[0], small[1]])), max_num_seqs=16)
    pairs = [tuple(r.choices[0].token_ids) for r in results.values()]
    assert all(a in small and b in small for a, b in pairs)
    proposed = sum(r.speculation.proposed for r in results.values() if r.speculation)
    kept = accepted(results)
    assert proposed > 0 and 0 < kept < proposed  # both acceptances and rejections were exercised

    bias_vector = np.zeros(model.args.vocab_size, dtype=np.float32)
    bias_vector[small] = 100.0
    first = np.exp(log_softmax(teacher_forced_logits(model, prompt, [small[0]])[0] + bias_vector))
    expected, observed = [], []
    for a in small:
        second = np.exp(log_softmax(teacher_forced_logits(model, prompt, [a, small[0]])[1] + bias_vector))
        for b in small:
            expected.append(rows * first[a] * second[b])
            observed.append(sum(1 for pair in pairs if pair == (a, b)))
    expected_cells, observed_cells, rest = [], [], [0.0, 0.0]
    for e, o in zip(expected, observed):  # cells expected under 5 times are pooled
        if e >= 5:
            expected_cells.append(e)
            observed_cells.append(o)
        else:
            rest[0] += e
            rest[1] += o
    if rest[0] > 0:
        expected_cells.append(rest[0])
        observed_cells.append(rest[1])
    scale = sum(observed_cells) / sum(expected_cells)  # the 4-token mass is 1 - 1e-40: rounding only
    _, p_value = chisquare(observed_cells, [e * scale for e in expected_cells])
    assert len(expected_cells) >= 4 and p_value > 0.001, (observed, expected)


class OracleDrafter(FixedDrafter):
    """Proposes what the row makes without speculation (`reference`, after a prompt of `prompt_length`)."""

    def __init__(self, prompt_length: int, reference: list[int]) -> None:
        super().__init__(reference)
        self.prompt_length = prompt_length

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        return [self.tokens[len(row.tokens) - self.prompt_length:][: row.k] for row in rows]


def test_stop_tokens_stop_strings_and_max_tokens_end_rows_where_they_end_without_speculation(target):
    """A stop token inside an accepted run ends the row there; a stop string is cut as without
    speculation; max_tokens is never passed."""
    model, tokenizer = target
    # (greedy rows of the tiny random models repeat one token: a seeded row's text varies)
    base = {"prompt_token_ids": looping_prompt(3, 30), "max_tokens": 40, "temperature": 0.6, "seed": 3,
            "ignore_eos": True}
    without, _ = run(model, tokenizer, {"base": base})
    tokens = without["base"].choices[0].token_ids
    stop_token = tokens[10]  # it ends the row at its first occurrence
    pieces = [tokenizer.decode([t]).strip() for t in tokens[10:]]
    stop_string = next(p for p in pieces if len(p) >= 2 and p.isalnum())
    requests = {"stop_token": {**base, "stop_token_ids": [stop_token]},
                "stop_string": {**base, "stop": [stop_string]},
                "short": {**base, "max_tokens": 7}}
    reference, _ = run(model, tokenizer, requests)
    oracle = OracleDrafter(len(base["prompt_token_ids"]), tokens)  # every proposal right: runs pass the stops
    got, _ = run(model, tokenizer, requests, speculator_for(oracle))
    assert_same(got, reference)
    assert got["stop_token"].choices[0].token_ids[-1] == stop_token and got["stop_token"].choices[0].finish_reason == "stop"
    assert got["stop_string"].choices[0].finish_reason == "stop" and stop_string not in got["stop_string"].choices[0].text
    assert len(got["short"].choices[0].token_ids) == 7
    assert all(r.speculation is not None and r.speculation.accepted > 0 for r in got.values())


class GradedFixedDrafter(FixedDrafter):
    """FixedDrafter on the graded policy (graded.py), every proposal of one grade."""

    graded = True


@pytest.mark.parametrize("policy", ["adaptive", "graded"])
def test_opted_out_and_refused_rows_decode_beside_speculating_ones(target, itself, caplog, policy):
    """`speculative: false`, penalties and structured output never propose (each refusal logged
    once), under either policy; they give their own tokens while a speculating row shares their steps."""
    model, tokenizer = target
    prompt = looping_prompt(2, 24)
    requests = {
        "free": {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        "opted_out": {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                      "speculative": False},
        "penalty": {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "repetition_penalty": 1.3, "logprobs": True},
        "penalty2": {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                     "presence_penalty": 0.5},
        "json": {"prompt": "Answer in JSON:", "max_tokens": 16, "temperature": 0,
                 "response_format": {"type": "json_object"}},
    }
    without, _ = run(model, tokenizer, requests)
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        # The model as its own draft, or the free row's own answer proposed again and again; at a pass
        # cost of 1.25 one speculating row beside four that do not pays for a pass.
        drafter = (DraftModelDrafter(itself, model.args.vocab_size) if policy == "adaptive"
                   else GradedFixedDrafter(without["free"].choices[0].token_ids[:4]))
        got, _ = run(model, tokenizer, requests, speculator_for(drafter, pass_cost=1.25))
    assert_same(got, without)
    assert got["free"].speculation is not None and got["free"].speculation.accepted > 0
    assert all(got[job].speculation is None for job in ("opted_out", "penalty", "penalty2", "json"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculation: rows with")]
    assert len(lines) == 2 and any("penalties" in line for line in lines) and any("structured" in line for line in lines)


def test_a_cancelled_row_ends_and_the_others_go_on(target, itself):
    model, tokenizer = target
    requests = {f"c{i}": {"prompt_token_ids": looping_prompt(i, 20), "max_tokens": 30, "temperature": 0,
                          "ignore_eos": True} for i in range(3)}
    without, _ = run(model, tokenizer, requests)
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4,
                            speculator=speculator_for(DraftModelDrafter(itself, model.args.vocab_size)))
    scheduler = BatchScheduler(engine, max_num_seqs=4)
    for job_id, request in requests.items():
        assert scheduler.admit(job_id, request) is None
    results = {}
    for _ in range(3):
        for ended in scheduler.step():
            results[ended.id] = ended.result()
    cancelled = scheduler.cancel("c1")
    assert cancelled is not None
    results["c1"] = cancelled.result()
    while len(scheduler):
        for ended in scheduler.step():
            results[ended.id] = ended.result()
    assert results["c1"].status == "cancelled"
    assert engine.num_active == 0
    assert_same({k: v for k, v in results.items() if k != "c1"}, {k: v for k, v in without.items() if k != "c1"})


def test_a_weight_swap_starts_the_drafter_over_and_the_new_weights_decide(tiny_model_dir, other_dir):
    """Rows after a swap get the new weights' tokens (what mlx-lm gives with those weights alone),
    and the draft model's caches of the old rows are dropped."""
    model, tokenizer = load(tiny_model_dir)  # its own copy: the swap changes it
    other, _ = load(other_dir)
    drafter = DraftModelDrafter(load(tiny_model_dir)[0], model.args.vocab_size)
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, speculator=speculator_for(drafter))
    scheduler = BatchScheduler(engine, max_num_seqs=4)
    first = {"prompt_token_ids": looping_prompt(1, 20), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    assert scheduler.admit("before", first) is None
    for _ in range(2):
        scheduler.step()
    assert drafter.rows
    engine.swap_weights([f"{other_dir}/model.safetensors"], 1)
    assert not drafter.rows
    results = run_all(scheduler, {"after": first})
    tokens, _ = greedy_alone(other, first["prompt_token_ids"], first["max_tokens"], set())
    assert results["after"].choices[0].token_ids == tokens
    assert results["after"].weight_version == 1


def test_adaptivity_turns_a_row_off_after_misses_and_grows_k_on_full_acceptance():
    row = RowAdaptivity(max_k=5)
    for _ in range(4):
        row.record(row.k, row.k)
    assert row.k == 5 and row.on
    row.record(5, 2)
    assert row.k == 3 and row.on
    row.record(3, 0)
    row.record(1, 0)  # two misses in a row: off for the first backoff
    assert not row.on and row.off_for == FIRST_BACKOFF
    for _ in range(FIRST_BACKOFF):
        row.decoded()
    assert row.probe_due and not row.on  # a probe: one miss turns it off again, for twice as long
    row.record(0, 0)
    assert row.off_for == 2 * FIRST_BACKOFF
    for _ in range(2 * FIRST_BACKOFF):
        row.decoded()
    row.record(2, 2)  # a probe accepted whole: on, and the backoff starts over
    assert row.on and row.backoff == FIRST_BACKOFF


class WrongDrafter(FixedDrafter):
    """Proposes a token that the row's model never makes next (a logit bias of -100 keeps it out)."""


def test_a_drafter_that_always_misses_costs_two_verification_steps(target):
    """Open-ended output where every proposal is rejected: the row stops proposing after two misses,
    and its probes, ever rarer, are checked against the tokens it makes, with no pass: a 120-token
    answer takes two verification passes."""
    model, tokenizer = target
    request = {"prompt_token_ids": looping_prompt(4, 20), "max_tokens": 120, "temperature": 0, "ignore_eos": True,
               "logit_bias": {"7": -100.0}}
    without, _ = run(model, tokenizer, {"open": request})
    got, engine = run(model, tokenizer, {"open": request}, speculator_for(WrongDrafter([7, 7, 7])))
    assert_same(got, without)
    counters = engine.stats().counters
    assert got["open"].speculation.accepted == 0
    assert counters["speculative_steps"] == 2  # the two misses at the start
    # Then a probe of 2 tokens after 16, 32 and 64 more steps, each missed.
    assert counters["speculative_probed"] == 6 and counters["speculative_probes_accepted"] == 0


def test_a_probe_is_decided_by_the_tokens_the_row_makes():
    """A row that is off probes when its wait is over: the drafter guesses from the tokens the row
    has, no pass runs, and the tokens the row makes next decide. A guess they bear out whole turns
    the row back on; a miss, known at the first token that differs, turns it off for twice as long."""
    speculator = speculator_for(FixedDrafter([5, 6]), max_k=4)
    row = PolicyRow("row")
    speculator.outcome(row, 2, 0)
    speculator.outcome(row, 2, 0)
    adaptivity = speculator.adaptivity(row)
    for _ in range(FIRST_BACKOFF):
        speculator.step_began([row], slot_count=1)
    assert adaptivity.probe_due and speculator.width([row], 1) == 1  # a probe runs no pass
    row.generated.append(5)  # the probe (made at the last step) guessed 5, 6: one token bears it out so far
    speculator.step_began([row], slot_count=1)
    assert adaptivity.probe_due and speculator.probed == 0
    row.generated.append(6)
    speculator.step_began([row], slot_count=1)
    assert adaptivity.on and (speculator.probed, speculator.probes_accepted) == (2, 2)
    assert speculator.proposed == 4 and speculator.width([row], 1) > 1  # (probes are not verified proposals)
    speculator.outcome(row, 3, 0)
    speculator.outcome(row, 3, 0)
    for _ in range(FIRST_BACKOFF):
        speculator.step_began([row], slot_count=1)
    row.generated += [7, 5]  # the probe's guess was 5, 6: missed at its first token
    speculator.step_began([row], slot_count=1)
    assert adaptivity.off_for == 2 * FIRST_BACKOFF and (speculator.probed, speculator.probes_accepted) == (4, 2)


def test_the_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter()
    assert drafter.propose([DraftRow("a", [1, 2, 3, 4, 5, 6, 1, 2, 3], 3)]) == [[4, 5, 6]]
    assert drafter.propose([DraftRow("a", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9, 2, 3], 2)]) == [[4, 9]]  # latest
    assert drafter.propose([DraftRow("b", [8, 9, 10], 4)]) == [[]]
    assert drafter.propose([DraftRow("c", [5, 1, 7, 5], 4)]) == [[1, 7, 5]]  # n = 1 and runs to the end
    # a row whose tokens are not an extension of those indexed (another first token, or fewer) is indexed
    # afresh: the old index would propose [5, 5], then nothing
    assert drafter.propose([DraftRow("a", [5] * 11 + [1, 2], 2)]) == [[]]
    assert drafter.propose([DraftRow("a", [1, 2, 9, 1, 2], 2)]) == [[9, 1]]


def test_a_draft_model_of_another_tokenizer_is_refused(tmp_path, target, tiny_model_dir):
    _, tokenizer = target
    stranger = make_tiny_model(tmp_path / "stranger", extra_special_tokens=("<other>",))
    _, stranger_tokenizer = load(str(stranger))
    with pytest.raises(VocabularyMismatch, match="MLXQ_DRAFT_MODEL: its tokenizer differs"):
        check_same_vocabulary(tokenizer, stranger_tokenizer)
    from worker.loading import ModelLoadError, build_speculator
    from worker.settings import WorkerSettings

    settings = WorkerSettings(model=tiny_model_dir, speculative="draft", draft_model=str(stranger))
    with pytest.raises(ModelLoadError, match="MLXQ_DRAFT_MODEL: its tokenizer differs"):
        build_speculator(settings, target[0], tokenizer)


def test_settings_and_mlx_lms_path(tiny_model_dir, target, caplog):
    from worker.engines.text import TextEngine
    from worker.loading import engine_for_model
    from worker.settings import SettingsError, WorkerSettings

    with pytest.raises(SettingsError, match="MLXQ_SPECULATIVE=draft needs MLXQ_DRAFT_MODEL"):
        WorkerSettings.from_env({}, model=tiny_model_dir, speculative="draft")
    with pytest.raises(SettingsError, match="MLXQ_SPECULATIVE must be off, ngram or draft"):
        WorkerSettings.from_env({"MLXQ_SPECULATIVE": "eagle"}, model=tiny_model_dir)
    with pytest.raises(SettingsError, match="MLXQ_SPECULATIVE_K must be 1..16"):
        WorkerSettings.from_env({"MLXQ_SPECULATIVE": "ngram", "MLXQ_SPECULATIVE_K": "0"}, model=tiny_model_dir)
    settings = WorkerSettings.from_env({"MLXQ_SPECULATIVE": "ngram", "MLXQ_DECODE": "batch-generator"},
                                       model=tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="mlxq.worker"):
        engine = engine_for_model(settings, *target)
    assert isinstance(engine, TextEngine)
    assert any("needs the compiled decode path" in r.getMessage() for r in caplog.records)


def test_adapter_rows_and_scored_prompts_speculate_exactly(tmp_path, target):
    """Rows of two LoRA adapters and base rows, and a row that scores its prompt, speculate in one
    batch (the adapted model verifies) with the tokens, logprobs and prompt scores they get without."""
    from worker.adapters import AdapterCatalog
    from worker.tiny_model import make_tiny_adapter

    model, tokenizer = target
    make_tiny_adapter(tmp_path / "alpha", model, keys=("self_attn.q_proj", "self_attn.v_proj"), rank=4, scale=10.0,
                      seed=1, strength=0.3)
    make_tiny_adapter(tmp_path / "beta", model, keys=("mlp.gate_proj", "mlp.up_proj"), rank=2, scale=20.0, seed=2,
                      strength=0.2)
    requests = {f"a{i}": {"prompt_token_ids": looping_prompt(i, 18 + 4 * i), "max_tokens": 20, "temperature": 0,
                          "logprobs": True, "ignore_eos": True, **({"adapter": name} if name else {})}
                for i, name in enumerate([None, "alpha", "beta", "alpha", None])}
    requests["scored"] = {"prompt_token_ids": looping_prompt(6, 20), "max_tokens": 12, "temperature": 0,
                          "prompt_logprobs": 2, "ignore_eos": True}

    def run_with(speculator):
        engine = CompiledEngine(model, tokenizer, max_num_seqs=8, adapters=AdapterCatalog(tmp_path),
                                speculator=speculator)
        return run_all(BatchScheduler(engine, max_num_seqs=8), dict(requests))

    without = run_with(None)
    got = run_with(speculator_for(NgramDrafter()))
    assert_same(got, without)
    assert got["scored"].prompt_logprobs == without["scored"].prompt_logprobs is not None
    assert all(got[job].speculation is not None for job in requests) and accepted(got) > 0


class PolicyRow:
    """What the speculation policy reads of a decoding row (speculator.py's `Row`)."""

    def __init__(self, uid: str, speculative: bool = True) -> None:
        from worker.engines.base import SequenceSpec

        self.spec = SequenceSpec(uid=uid, prompt_token_ids=[1, 2], max_tokens=50, speculative=speculative)
        self.prompt, self.generated, self.constraint = [1, 2], [3], None


def test_prompt_lookup_waits_for_a_rows_first_token_and_a_draft_model_does_not():
    """A row's first token follows the chat template's assistant header, which prompt lookup can
    only match against the template's own earlier newlines: such a proposal would mostly miss. Its
    rows propose from their first token on; a draft model's rows propose from the start."""
    lookup, drafting = speculator_for(NgramDrafter(), max_k=4), speculator_for(FixedDrafter([5, 6]), max_k=4)
    row = PolicyRow("new")
    row.prompt, row.generated = [9, 5, 6, 7, 8, 9, 5, 6, 7], []
    lookup.step_began([row], 1)
    assert lookup.width([row], 1) == 1 and lookup.plan([row], 1) is None and lookup.probed == 0
    assert drafting.width([row], 1) > 1
    row.generated = [8]
    plan = lookup.plan([row], 1)
    assert plan is not None and plan.rows[0].draft == [9, 5, 6, 7]  # what followed 6, 7, 8


def test_rows_that_are_off_ride_along_in_a_pass_run_for_others():
    """A pass runs every slot at its full width, so a row that is off proposes in it for free: its
    misses leave its backoff as it was, and a ride accepted whole turns it back on."""
    speculator = speculator_for(FixedDrafter([5, 6, 7, 8]), max_k=4)
    on, off = PolicyRow("on"), PolicyRow("off")
    speculator.outcome(off, 2, 0)
    speculator.outcome(off, 2, 0)  # two misses: off
    waiting = speculator.adaptivity(off).off_for
    assert waiting > 0
    assert speculator.plan([off], slot_count=1) is None  # no row is on: no pass for the off row alone
    plan = speculator.plan([on, off], slot_count=2)
    assert plan is not None and plan.width == 3  # the new row's k (2) sets the width
    assert [(r.seq.spec.uid, r.draft) for r in plan.rows] == [("on", [5, 6]), ("off", [5, 6])]
    speculator.outcome(off, 2, 1)
    assert speculator.adaptivity(off).off_for == waiting  # a ride's miss costs it nothing
    speculator.outcome(off, 2, 2)
    assert speculator.adaptivity(off).on and speculator.accepted == 3


def test_rows_start_off_while_their_drafter_keeps_missing():
    """A new row gets two proposals to show its worth, unless the drafter's recent proposals for other
    rows mostly missed: then it starts off, waiting as long as the row that last turned off, and then
    probes once. After MAX_BACKOFF steps without a proposal the drafter gets a new chance."""
    class DraftLike(FixedDrafter):
        judged_as_a_whole = True  # as a draft model is

    speculator = speculator_for(DraftLike([5, 6]), max_k=4)
    early = PolicyRow("early")
    speculator.outcome(early, 2, 0)
    assert speculator.adaptivity(early).on  # its first miss: one more try
    speculator.outcome(early, 2, 0)
    assert speculator.adaptivity(early).off_for == FIRST_BACKOFF
    speculator.outcome(PolicyRow("other"), 2, 0)
    assert speculator.track < 0.2
    late = speculator.adaptivity(PolicyRow("late"))
    assert not late.on and late.off_for == FIRST_BACKOFF
    for _ in range(FIRST_BACKOFF):
        late.decoded()
    assert late.probe_due  # its probe: one miss turns it off for twice as long
    late.record(2, 0)
    assert late.off_for == 2 * FIRST_BACKOFF
    for _ in range(MAX_BACKOFF):
        speculator.step_began([], slot_count=1)
    assert speculator.adaptivity(PolicyRow("much later")).on


def test_the_pass_width_follows_the_costs_measured_while_serving():
    """Each width's cost is its passes' median time over the decode steps' at the same slot count,
    once both are measured (the prior until then; a pause in one sample does not move it; no pass before
    a step at that slot count is timed, as its passes could not be); the width chosen makes the most
    tokens per step's cost. A cost given as a setting is never measured, and a
    width not run for a while is measured afresh (a width measured too dear would never be run again)."""
    measured = speculator_for(FixedDrafter([5, 6, 7, 8]), max_k=4, pass_cost=2.0, measure_cost=True)
    fixed = speculator_for(FixedDrafter([5, 6, 7, 8]), max_k=4, pass_cost=2.0)
    rows = [PolicyRow(f"r{i}") for i in range(8)]
    for speculator in (measured, fixed):
        for row in rows:
            speculator.outcome(row, 2, 2)
            speculator.outcome(row, 3, 3)  # k 4, running acceptance 0.755
        assert speculator.width(rows, 8) == (1 if speculator is measured else 5)  # no step timed at 8 slots yet
        for seconds in (0.1, 0.1, 0.1, 2.0):
            speculator.costs.step_took(8, seconds)
        assert speculator.width(rows, 8) == 5  # every width at the prior: the widest makes the most
        for width, seconds in ((5, 0.3), (3, 0.14)):
            for _ in range(3):
                speculator.costs.pass_took(8, width, seconds)
    assert measured.costs.cost(8, 5) == pytest.approx(3.0) and measured.costs.cost(8, 4) == 2.0
    assert measured.costs.cost(8, 3) == pytest.approx(1.4) and measured.costs.cost(4, 3) == 2.0
    assert measured.width(rows, 8) == 3  # 8 + 12.1 tokens for 1.4 steps beat 8 + 18.1 for 2 and 8 + 24.2 for 3
    assert fixed.width(rows, 8) == 5 and fixed.costs.cost(8, 3) == 2.0
    for _ in range(FORGET_AFTER + 1):  # a width left unused that long is tried afresh
        measured.costs.step_took(8, 0.1)
    assert measured.costs.cost(8, 5) == 2.0 and measured.width(rows, 8) == 5


@pytest.mark.parametrize("draft_steps", [1.0, 0.05], ids=["as-dear-as-the-model", "cheap"])
def test_a_draft_is_priced_at_what_its_calls_cost(draft_steps):
    """A draft model's calls are timed apart and priced per proposed position: a draft that costs what
    the served model does (the model as its own draft) runs no pass and no probe however well its
    proposals are accepted, where a cheap one with the same acceptance runs passes and probes."""
    step = 0.01

    class TimedDraft(FixedDrafter):
        judged_as_a_whole = True
        calls = 0

        def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
            TimedDraft.calls += 1
            time.sleep(max(row.k for row in rows) * draft_steps * step)
            return super().propose(rows)

    speculator = speculator_for(TimedDraft([5, 6, 7, 8]), max_k=4, pass_cost=1.2, measure_cost=True)
    rows = [PolicyRow(f"r{i}") for i in range(3)]
    for _ in range(3):
        speculator.costs.step_took(4, step)
    for _ in range(3):  # until three proposals are timed the draft costs nothing: rows are tried
        plan = speculator.plan(rows, 4)
        assert plan is not None
        for row_plan in plan.rows:
            speculator.outcome(row_plan.seq, len(row_plan.draft), len(row_plan.draft))  # accepted whole
    dear = draft_steps >= 1
    draft = speculator.costs.draft_cost(4)
    assert draft >= 1 if dear else draft < 0.5, draft  # (a sleep may overrun, never fall short)
    assert speculator.costs.cost(4, 5) == pytest.approx(1.2 + 4 * draft)
    assert speculator.costs.learnt()["draft position 4"] == pytest.approx(draft, abs=1e-3)
    assert (speculator.width(rows, 4) == 1) is dear
    late = PolicyRow("late")  # a row of a draft that kept missing starts off, and probes once its wait is over
    speculator.track = 0.0
    state = speculator.adaptivity(late)
    while not state.probe_due:
        state.decoded()
    before = TimedDraft.calls
    speculator.step_began([*rows, late], 4)
    assert (TimedDraft.calls == before) is dear  # no probe where no pass could pay


def test_a_verification_pass_needs_enough_expected_tokens_for_the_whole_batch(target):
    """A row that may propose is worth the batch's wider pass when its expected tokens cover the pass's
    extra cost for every row of the batch; a batch too large for `max_positions` never speculates."""
    Row = PolicyRow
    speculator = speculator_for(FixedDrafter([5, 6, 7, 8]), max_k=4, max_positions=64)  # a pass costs 1.25 steps
    lone = [Row("on", True)]  # new: expected to add its k (2) tokens
    assert speculator.wants(lone + [Row(f"off{i}", False) for i in range(7)], slot_count=8)
    assert not speculator.wants(lone + [Row(f"off{i}", False) for i in range(15)], slot_count=16)
    assert not speculator.wants([Row(f"r{i}", True) for i in range(40)], slot_count=48)  # 48 x 2 > 64
    on_cpu = speculator_for(FixedDrafter([5, 6, 7, 8]), max_k=4, max_positions=64, pass_cost=2.0)  # a token a row
    assert on_cpu.wants(lone + [Row("off0", False)], slot_count=2)
    assert not on_cpu.wants(lone + [Row(f"off{i}", False) for i in range(2)], slot_count=3)
    wide = [Row(f"r{i}", True) for i in range(32)]  # 32 slots: passes of 2 positions, one token a row
    assert not on_cpu.wants(wide, slot_count=32)  # half a token a row (the prior) does not pay 2 steps
    assert speculator.wants(wide, slot_count=32)  # but pays 1.25
    on_cpu.outcome(lone[0], 2, 2)
    on_cpu.outcome(lone[0], 3, 0)  # no longer new: its running acceptance (0.455) times its k (2) counts
    assert not on_cpu.wants(lone, slot_count=1)


def test_requests_opt_out_through_the_client_schema_and_the_gateway():
    from producer.openai_requests import CHAT_PATH, parse_openai_request, to_generation_requests
    from schemas import GenerationRequest, InvalidRequestError

    assert GenerationRequest(prompt="hi").speculative is True
    assert GenerationRequest(prompt="hi", speculative=False).speculative is False
    with pytest.raises(InvalidRequestError, match="speculative"):
        GenerationRequest.validate_payload({"prompt": "hi", "speculative": "no"})
    body = parse_openai_request(CHAT_PATH, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "speculative": False})
    assert [r.speculative for r in to_generation_requests(body)] == [False]


def test_rows_that_ended_leave_nothing_behind(target, itself):
    """The policy and the draft model keep nothing of rows that ended (rows end inside verification
    passes here: max_tokens, stop tokens)."""
    model, tokenizer = target
    drafter = DraftModelDrafter(itself, model.args.vocab_size)
    speculator = speculator_for(drafter)
    run(model, tokenizer, GREEDY_BATCH, speculator)
    assert speculator.stats()["speculative_accepted"] > 0
    assert not drafter.rows and speculator.tracked_rows == 0


def draft_greedy_alone(model: Any, tokens: list[int], k: int, vocab: int) -> list[int]:
    """The draft model's greedy continuation of `tokens` alone: a plain forward loop on a fresh mlx-lm cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    continuation: list[int] = []
    for _ in range(k):
        continuation.append(int(mx.argmax(logits[0, -1, :vocab])))
        logits = model(mx.array([continuation[-1:]]), cache=cache)
    return continuation


@pytest.mark.parametrize("prefill_step", [2048, 16])
def test_the_batched_draft_model_proposes_each_rows_greedy_continuation_alone(unrelated, prefill_step):
    """Rows of different lengths asking for different k in one batched drafter, over rounds in which
    their proposals are wholly, partly or not accepted (their tokens then diverge from what the draft
    slots hold), rows skip rounds (more tokens to catch up than the catch-up call takes), join past
    the first slots and length bucket, and end: every proposal is the draft model's greedy
    continuation of the row's tokens computed alone."""
    vocab = unrelated.args.vocab_size
    rng = np.random.default_rng(11)
    drafter = DraftModelDrafter(unrelated, vocab, prefill_step=prefill_step)
    tokens = {f"r{i}": rng.integers(3, vocab, size=n).tolist() for i, n in enumerate([5, 17, 40, 3, 150, 1])}
    outcomes = {"all": 0, "part": 0, "none": 0, "skipped": 0, "diverged": 0}
    holds: dict[str, list[int]] = {}  # what each row's draft slot holds after its last proposal
    for round_ in range(12):
        if round_ == 3:  # two rows end, three join (one longer than the buffers so far)
            for uid in ("r1", "r3"):
                drafter.forget(uid)
                del tokens[uid]
            tokens |= {f"r{i}": rng.integers(3, vocab, size=n).tolist() for i, n in ((6, 200), (7, 9), (8, 30))}
        rows = [DraftRow(uid, list(t), int(rng.integers(0, 5))) for uid, t in tokens.items()]
        for row in rows:  # a row whose slot holds rejected tokens before its last one, which it must drop
            held = holds.get(row.uid, [])[: len(row.tokens) - 1]
            outcomes["diverged"] += bool(row.k) and held != list(row.tokens[: len(held)])
        for row, proposal in zip(rows, drafter.propose(rows)):
            assert proposal == draft_greedy_alone(unrelated, row.tokens, row.k, vocab), (round_, row.uid)
            if row.k:
                holds[row.uid] = list(row.tokens) + proposal[:-1]
            if not row.k:  # it decoded without asking: several tokens of its own
                tokens[row.uid] += rng.integers(3, vocab, size=int(rng.integers(1, 8))).tolist()
                outcomes["skipped"] += 1
                continue
            kept = int(rng.integers(0, row.k + 1))
            outcomes["all" if kept == row.k else "part" if kept else "none"] += 1
            drawn = int(rng.integers(3, vocab))
            if kept < row.k and drawn == proposal[kept]:
                drawn = (drawn + 1) % vocab  # the served model's draw differs where it rejected
            tokens[row.uid] += proposal[:kept] + [drawn]
    assert all(outcomes.values()), outcomes
    assert sorted(drafter.rows) == sorted(tokens)
    for uid in list(tokens):
        drafter.forget(uid)
    assert not drafter.rows


def test_a_new_row_caught_up_at_the_end_of_its_buffer_writes_nothing_past_it(unrelated):
    """A new row's prompt runs through the gathered prefill, then its last token through the catch-up
    call. That call used to keep the width the row's run had before the prefill (4), padding the last
    token 3 positions past the row's end, while the buffers were sized for k more: a new row of 126
    tokens with k = 2 wrote position 128 of a 128-position buffer, which MLX's scatter does not check
    (a process crashed in malloc). The buffers now refuse such a write, and the proposals are the rows' own."""
    vocab = unrelated.args.vocab_size
    rng = np.random.default_rng(5)
    for lengths, ks in (((126,), (2,)), ((127,), (1,)), ((126, 3), (2, 3)), ((125, 40), (3, 1))):
        drafter = DraftModelDrafter(unrelated, vocab)
        rows = [DraftRow(f"r{i}", rng.integers(3, vocab, size=n).tolist(), k) for i, (n, k) in enumerate(zip(lengths, ks))]
        for row, proposal in zip(rows, drafter.propose(rows)):
            assert proposal == draft_greedy_alone(unrelated, row.tokens, row.k, vocab), (lengths, row.uid)


_draft_rows = st.lists(st.tuples(st.one_of(st.integers(1, 12), st.integers(116, 130)), st.integers(0, 4)),
                      min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=_draft_rows, grown=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 4)), min_size=4, max_size=4))
def test_draft_rows_of_any_length_near_a_buffer_end_propose_their_own_continuation(unrelated, first, grown):
    """Rows of lengths around the first length bucket's end (128), asking for 0 to 4 tokens, then
    grown by a few tokens of their own and asking again: every proposal is the row's greedy
    continuation alone, and no call writes past the buffers (they refuse it)."""
    vocab = unrelated.args.vocab_size
    rng = np.random.default_rng(len(first))
    drafter = DraftModelDrafter(unrelated, vocab)
    tokens = {f"r{i}": rng.integers(3, vocab, size=n).tolist() for i, (n, _) in enumerate(first)}
    for round_ in range(2):
        ks = [k for _, k in first] if round_ == 0 else [k for _, k in grown[: len(first)]]
        rows = [DraftRow(uid, list(t), k) for (uid, t), k in zip(tokens.items(), ks)]
        for row, proposal in zip(rows, drafter.propose(rows)):
            assert proposal == draft_greedy_alone(unrelated, row.tokens, row.k, vocab), (round_, row.uid, len(row.tokens))
        for (uid, t), (extra, _) in zip(tokens.items(), grown):
            t += rng.integers(3, vocab, size=extra).tolist()


def test_admission_counts_a_draft_models_keys_and_values_with_the_served_models(target, unrelated):
    """A draft model keeps slot buffers of its own, as large as the engine's: the engine's bytes per
    token are both models', so the KV budget bounds both, and a request that fits the served model's
    alone is refused with a draft beside it. Prompt lookup keeps nothing per token."""
    model, tokenizer = target
    plain = CompiledEngine(model, tokenizer)
    drafted = CompiledEngine(model, tokenizer, speculator=speculator_for(DraftModelDrafter(unrelated, model.args.vocab_size)))
    ngram = CompiledEngine(model, tokenizer, speculator=speculator_for(NgramDrafter()))
    draft_per_token = KVLayout.of(unrelated).bytes_per_token
    assert draft_per_token > 0 and ngram.kv_bytes_per_token == plain.kv_bytes_per_token
    assert drafted.kv_bytes_per_token == plain.kv_bytes_per_token + draft_per_token
    assert drafted.kv_bytes_for(5, 130) == 6 * 192 * drafted.kv_bytes_per_token  # bucketed, as the engine's
    request = {"prompt_token_ids": looping_prompt(0, 100), "max_tokens": 28, "temperature": 0}
    budget = (100 + 28) * plain.kv_bytes_per_token
    assert BatchScheduler(plain, max_num_seqs=2, kv_budget_bytes=budget).admit("fits", dict(request)) is None
    refused = BatchScheduler(drafted, max_num_seqs=2, kv_budget_bytes=budget).admit("too big", dict(request))
    assert refused is not None and refused.status == "failed", refused
    assert refused.error.message.startswith("max_tokens: ") and "MLXQ_KV_BUDGET_MB" in refused.error.message


def test_a_draft_models_buffers_share_the_budget_and_are_sized_exactly_where_buckets_would_pass_it(target, itself):
    """Admission counts both models' keys and values (above), but the draft's buffers were bucketed
    whatever the budget: 5 rows of 128 tokens took 6 slots, past what admission had counted. Each model now has its share of the budget (in proportion to its
    bytes per token) and, as the engine did alone, sizes its buffers exactly where buckets would
    pass it; the tokens stay those of decoding without a draft. (The model is its own draft: its rows
    keep asking to their last token.)"""
    model, tokenizer = target
    requests = {f"r{i}": {"prompt_token_ids": looping_prompt(i, 100), "max_tokens": 28, "temperature": 0,
                          "ignore_eos": True} for i in range(5)}
    reference = run_all(BatchScheduler(CompiledEngine(model, tokenizer), max_num_seqs=8), dict(requests))
    served, draft = KVLayout.of(model).bytes_per_token, KVLayout.of(itself).bytes_per_token
    budget = 5 * 128 * (served + draft)  # 5 rows of 128 positions, exactly; 6 bucketed slots would pass it
    draft_share = budget - budget * served // (served + draft)

    def peak_draft_bytes(kv_budget: int) -> int:
        drafter = DraftModelDrafter(itself, model.args.vocab_size)
        engine = CompiledEngine(model, tokenizer, max_num_seqs=8, kv_budget_bytes=kv_budget,
                                speculator=speculator_for(drafter))
        results = {}
        scheduler = BatchScheduler(engine, max_num_seqs=8, kv_budget_bytes=kv_budget)
        assert not any(scheduler.admit(job_id, dict(request)) for job_id, request in requests.items())
        peak = 0
        while len(scheduler):
            for ended in scheduler.step():
                results[ended.id] = ended.result()
            if (buffers := drafter._table.buffers) is not None:
                peak = max(peak, buffers.slots * buffers.length * draft)
        assert_same(results, reference)
        return peak

    assert peak_draft_bytes(0) > draft_share  # bucketed: past the draft's share of that budget
    assert 0 < peak_draft_bytes(budget) <= draft_share


def test_slot_buffers_refuse_a_write_past_their_end():
    buffers = SlotBuffers.allocate(KVLayout([(2, 4)], [(2, 4)], mx.float32), 2, 16)
    buffers.check_room([15, 3], 1)
    with pytest.raises(RuntimeError, match="write up to position 17 of a buffer of 16"):
        buffers.check_room([3, 15], 2)


def test_a_draft_model_with_sliding_window_caches_is_refused(tmp_path, target):
    """Its rows could not share slot buffers (nor be rolled back)."""
    windowed = load(str(make_tiny_model(tmp_path / "windowed", arch="gemma3_text")))[0]
    with pytest.raises(ValueError, match="MLXQ_DRAFT_MODEL: .*RotatingKVCache"):
        DraftModelDrafter(windowed, target[0].args.vocab_size)


class _Prebuild:
    """A kernel prebuild as the engine reads it (worker/engines/kernel_prebuild.py), still running."""

    verify_ready = False
    done = False

    def ready(self, shape) -> bool:
        return True

    def stop(self) -> None:
        pass


def test_no_row_proposes_until_the_verification_kernels_are_built(target):
    """A first verification pass would build its kernels inside the worker, a stall of seconds for the
    whole batch: until the prebuild reports them, rows decode one token a step, with the same tokens."""
    model, tokenizer = target
    request = {"prompt_token_ids": looping_prompt(1, 30), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    without, _ = run(model, tokenizer, {"r": request})
    prebuild = _Prebuild()
    engine = CompiledEngine(model, tokenizer, max_num_seqs=2, speculator=speculator_for(NgramDrafter()))
    engine._prebuild = prebuild
    waiting = run_all(BatchScheduler(engine, max_num_seqs=2), {"r": request})
    assert engine.stats().counters["speculative_steps"] == 0
    prebuild.verify_ready = True
    built = run_all(BatchScheduler(engine, max_num_seqs=2), {"r2": request})
    assert engine.stats().counters["speculative_steps"] > 0
    assert waiting["r"].choices[0].token_ids == built["r2"].choices[0].token_ids == without["r"].choices[0].token_ids


def test_the_prebuild_process_builds_the_verification_pass_after_the_first_two_shapes(tiny_model_dir):
    """The process reports the pass's kernels after the first two shapes (which hold every kernel of one
    slot and of several), and the worker's side reads that report as the verification pass being ready."""
    out = io.StringIO()
    prebuild({"model": tiny_model_dir, "shapes": [[1, 128], [2, 128], [4, 128]], "upcast": True,
              "keep_quantized": False, "grouped_mask": False, "verify_widths": [2, 3], "parent": os.getppid()}, out)
    lines = out.getvalue().splitlines(keepends=True)
    assert [line.strip() for line in lines[:4]] == ["ready 1 128", "ready 2 128", "ready verify", "ready 4 128"]

    class Running:
        def wait(self) -> int:
            return 0

    reader = KernelPrebuild.__new__(KernelPrebuild)
    reader._ready, reader._verify_built, reader.finished_after, reader._started = set(), False, None, 0.0
    reader._process = Running()
    reader._read(io.StringIO("".join(lines[:2])))
    assert reader._ready == {(1, 128), (2, 128)} and not reader._verify_built
    reader._read(io.StringIO("".join(lines[:3])))
    assert reader._verify_built


@pytest.mark.parametrize("platform,tf32,dtype,warned", [
    ("cpu", "1", mx.float32, False), ("cuda", "0", mx.float32, False),  # float32 stays exact
    ("cuda", "1", mx.float32, True),  # TF32 matmuls round below float32
    ("cpu", "0", mx.bfloat16, True), ("metal", "0", mx.float16, True), ("cuda", "0", mx.bfloat16, True)])
def test_speculation_below_float32_warns_that_greedy_text_may_differ(tiny_model_dir, monkeypatch, caplog, platform,
                                                                     tf32, dtype, warned):
    import worker.loading
    from worker.loading import build_speculator
    from worker.settings import WorkerSettings

    monkeypatch.setattr(worker.loading, "current_platform", lambda: platform)
    monkeypatch.setenv("MLX_ENABLE_TF32", tf32)
    model, tokenizer = load(str(tiny_model_dir))
    model.set_dtype(dtype)
    with caplog.at_level(logging.WARNING, logger="mlxq.worker"):
        build_speculator(WorkerSettings.from_env({"MLXQ_SPECULATIVE": "ngram"}, model="unused"), model, tokenizer)
    assert any("rounds below float32" in r.getMessage() for r in caplog.records) == warned, caplog.text


@pytest.mark.parametrize("platform,cost", [("cpu", 2.0), ("cuda", 1.75), ("metal", 1.25)])
def test_the_pass_cost_starts_at_the_platforms_and_a_setting_fixes_it(target, monkeypatch, platform, cost):
    import worker.loading
    from worker.loading import build_speculator
    from worker.settings import WorkerSettings

    monkeypatch.setattr(worker.loading, "current_platform", lambda: platform)
    settings = WorkerSettings.from_env({"MLXQ_SPECULATIVE": "ngram"}, model="unused")
    default = build_speculator(settings, *target)
    assert default.pass_cost == cost and default.costs.measure  # the platform's cost until measured
    settings = WorkerSettings.from_env({"MLXQ_SPECULATIVE": "ngram", "MLXQ_SPECULATIVE_PASS_COST": "3"}, model="unused")
    given = build_speculator(settings, *target)
    assert given.pass_cost == 3.0 and not given.costs.measure


def test_the_engine_tells_the_policy_how_each_row_ended(target) -> None:
    """Rows that run to max_tokens end at their length, inside verification passes too; the policy
    counts them (graded.py weighs rows well ahead by the share that end early)."""
    model, tokenizer = target
    ended: list[tuple[str, int]] = []

    class Recording(GradedSpeculator):
        def ended(self, row: Any) -> None:
            ended.append((row.spec.uid, len(row.generated)))
            super().ended(row)

    speculator = Recording(NgramDrafter(), max_k=4)
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, speculator=speculator)
    requests = {f"r{i}": {"prompt_token_ids": looping_prompt(i, 24), "max_tokens": 12, "temperature": 0,
                          "ignore_eos": True} for i in range(3)}
    results = run_all(BatchScheduler(engine, max_num_seqs=4), requests)
    assert all(r.status == "finished" for r in results.values())
    assert speculator.stats()["speculative_accepted"] > 0
    assert sorted(ended) == [(f"{uid}#0", 12) for uid in sorted(requests)]  # (engine uids: request#choice)
    shares = speculator.endings.shares()  # one kind of row: these prompts and max_tokens
    assert len(shares) == 1 and all(share < 0.25 for share in shares.values()) and speculator.tracked_rows == 0


@pytest.mark.parametrize("rows, queued, backlog", [(2, True, False), (4, True, True), (4, False, False)])
def test_the_engine_tells_the_policy_whether_requests_wait_for_a_slot(target, rows: int, queued: bool,
                                                                     backlog: bool) -> None:
    """With every slot taken a row that ends sooner frees its slot for waiting work, unless the worker's
    latest poll found its queues empty; with a slot free nothing waits (graded.py weighs the rows of a
    batch nothing waits on by how far ahead they are)."""
    model, tokenizer = target
    seen: list[tuple[int, bool]] = []

    class Recording(GradedSpeculator):
        def step_began(self, rows_: Sequence[Any], slot_count: int, backlog: bool = False) -> None:
            seen.append((len(rows_), backlog))
            super().step_began(rows_, slot_count, backlog)

    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, speculator=Recording(NgramDrafter(), max_k=4))
    requests = {f"r{i}": {"prompt_token_ids": looping_prompt(i, 24), "max_tokens": 12, "temperature": 0,
                          "ignore_eos": True} for i in range(rows)}
    scheduler = BatchScheduler(engine, max_num_seqs=4)
    scheduler.queue_seen(queued)
    results = run_all(scheduler, requests)
    assert all(r.status == "finished" for r in results.values())
    full = [told for count, told in seen if count == rows]
    assert full and all(told is backlog for told in full), seen
