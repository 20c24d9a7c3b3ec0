"""Property tests (hypothesis): random mixes of requests in one batch on the tiny real model.
Whatever the mix, every job ends, and usage, token lists, logprobs and stop strings agree."""

from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import worker  # noqa: F401
from mlx_lm import load

from tests.reference import run_all
from worker.engines.text import TextEngine
from worker.scheduler import BatchScheduler

_model = {}


def engine_scheduler(tiny_model_dir: str) -> BatchScheduler:
    if tiny_model_dir not in _model:
        _model[tiny_model_dir] = load(tiny_model_dir)
    model, tokenizer = _model[tiny_model_dir]
    return BatchScheduler(TextEngine(model, tokenizer, max_num_seqs=64), max_num_seqs=64)


requests = st.fixed_dictionaries(
    {
        "prompt_token_ids": st.lists(st.integers(3, 511), min_size=1, max_size=24),
        "max_tokens": st.integers(1, 12),
    },
    optional={
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        "top_p": st.floats(0.05, 1.0),
        "top_k": st.integers(0, 50),
        "min_p": st.floats(0.0, 0.5),
        "repetition_penalty": st.floats(0.5, 2.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=3),
        "seed": st.integers(0, 2**32),
        "stop": st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=4),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
        "n": st.integers(1, 4),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "logprobs_mode": st.sampled_from(["raw", "processed"]),
        "ignore_eos": st.booleans(),
    },
)


# MLXQ_PROPERTY_EXAMPLES=200 for a long run; the suite's default keeps it near half a minute.
@settings(max_examples=int(os.environ.get("MLXQ_PROPERTY_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests, min_size=1, max_size=6))
def test_every_job_ends_and_accounts_add_up(tiny_model_dir, batch):
    scheduler = engine_scheduler(tiny_model_dir)
    results = run_all(scheduler, {f"j{i}": r for i, r in enumerate(batch)})
    assert set(results) == {f"j{i}" for i in range(len(batch))}
    for i, request in enumerate(batch):
        result = results[f"j{i}"]
        assert result.status == "finished", result.error
        assert [c.index for c in result.choices] == list(range(request.get("n", 1)))
        assert result.usage.prompt_tokens == len(request["prompt_token_ids"])
        assert result.usage.completion_tokens == sum(len(c.token_ids) for c in result.choices)
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        wants_logprobs = request.get("logprobs") or request.get("top_logprobs", 0) > 0
        for choice in result.choices:
            assert 1 <= len(choice.token_ids) <= request["max_tokens"]
            assert choice.finish_reason in {"stop", "length"}
            if choice.finish_reason == "length":
                assert len(choice.token_ids) == request["max_tokens"]
            for stop in request.get("stop", []):
                assert stop not in choice.text
            if wants_logprobs:
                assert len(choice.logprobs) == len(choice.token_ids)
                # finite: the sampled token is always inside the distribution that is reported
                assert all(math.isfinite(lp) and lp <= 1e-4 for lp in choice.logprobs)
            else:
                assert choice.logprobs is None
            if request.get("top_logprobs"):
                assert len(choice.top_logprobs) == len(choice.token_ids)
                for top in choice.top_logprobs:
                    # null (-inf: outside the processed support) after every finite value
                    values = [-math.inf if t.logprob is None else t.logprob for t in top]
                    assert len(top) == request["top_logprobs"] and values == sorted(values, reverse=True)
    assert scheduler.engine.num_active == 0
