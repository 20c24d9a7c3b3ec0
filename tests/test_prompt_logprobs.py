"""Prompt log-probabilities (GenerationRequest.prompt_logprobs) on both text engines: batched with other
work (prompts only scored, scored and generating, joining a batch that decodes), equal to mlx-lm's own
forward pass over the same tokens (float32, within 1e-3), with or without the prefix cache."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from schemas import GenerationResult

ATOL = 1e-3


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: str) -> tuple[Any, Any]:
    import worker  # noqa: F401
    from mlx_lm import load

    return load(tiny_model_dir)


@pytest.fixture(scope="module", params=["batch-generator", "batch-generator-prefix-cache", "compiled",
                                        "compiled-first-token-from-the-prefill"])
def engine(loaded: tuple[Any, Any], request: pytest.FixtureRequest) -> Any:
    from worker.engines.compiled import CompiledEngine
    from worker.engines.text import TextEngine

    model, tokenizer = loaded
    if request.param.startswith("batch-generator"):
        cache = 64 << 20 if request.param.endswith("prefix-cache") else 0
        return TextEngine(model, tokenizer, max_num_seqs=16, prefix_cache_bytes=cache, prefix_min_match=16)
    return CompiledEngine(model, tokenizer, max_num_seqs=16, prefix_cache_bytes=64 << 20, prefix_min_match=16,
                          first_token_from_prefill=request.param.endswith("prefill"))


def forward_logprobs(model: Any, tokens: list[int], top: int) -> tuple[list[Optional[float]], list[list[tuple[int, float]]]]:
    """mlx-lm's model over the whole prompt at once: each token's logprob and the top entries."""
    import mlx.core as mx

    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = logprobs.tolist()
    own: list[Optional[float]] = [None] + [rows[i - 1][tokens[i]] for i in range(1, len(tokens))]
    tops = [[]] + [sorted(enumerate(rows[i - 1]), key=lambda p: -p[1])[:top] for i in range(1, len(tokens))]
    return own, tops


def run(engine: Any, first: dict[str, dict], joining: dict[str, dict], join_after: int = 3
        ) -> dict[str, GenerationResult]:
    from worker.scheduler import BatchScheduler

    scheduler = BatchScheduler(engine, max_num_seqs=16, default_max_tokens=16)
    results: dict[str, GenerationResult] = {}
    for job_id, payload in first.items():
        assert scheduler.admit(job_id, payload) is None
    steps = 0
    while len(scheduler) or joining:
        if joining and steps >= join_after:
            for job_id, payload in joining.items():
                assert scheduler.admit(job_id, payload) is None
            joining = {}
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        steps += 1
    return results


def check(result: GenerationResult, model: Any, tokens: list[int], top: int) -> None:
    assert result.status == "finished", result.error
    scores = result.prompt_logprobs
    assert scores is not None and scores.token_ids == tokens and len(scores.tokens) == len(tokens)
    own, tops = forward_logprobs(model, tokens, top)
    assert scores.logprobs[0] is None and len(scores.logprobs) == len(tokens)
    assert max(abs(a - b) for a, b in zip(scores.logprobs[1:], own[1:])) < ATOL  # type: ignore[operator]
    if top:
        assert scores.top_logprobs is not None and scores.top_logprobs[0] == []
        for got, want in zip(scores.top_logprobs[1:], tops[1:]):
            assert [t.token_id for t in got] == [t for t, _ in want]
            assert max(abs(t.logprob - v) for t, (_, v) in zip(got, want)) < ATOL
    else:
        assert scores.top_logprobs is None


def test_prompt_logprobs_equal_mlx_lms_forward_pass_batched_with_other_work(engine: Any, loaded: Any,
                                                                            reference: Any) -> None:
    model, tokenizer = loaded
    prompts = {name: tokenizer.encode(text) for name, text in {
        "short": "Hello world", "long": "The quick brown fox jumps over the lazy dog. " * 6,
        "mid": "A message queue carries jobs from web servers to workers.", "gen": "Tokens are sampled one step"}.items()}
    # A batch decoding, and the same long prompt generated first: with the prefix cache on it holds that
    # prompt's keys and values, which a scored prompt must not take in place of its logits.
    first = {"decoding": {"prompt": "Redis keeps the queue", "max_tokens": 24, "ignore_eos": True, "temperature": 0.0},
             "warm": {"prompt_token_ids": prompts["long"], "max_tokens": 2, "temperature": 0.0}}
    joining = {
        **{f"only-{name}": {"prompt_token_ids": prompts[name], "max_tokens": 0, "prompt_logprobs": 3}
           for name in ("short", "long", "mid")},
        "scored-gen": {"prompt_token_ids": prompts["gen"], "max_tokens": 5, "prompt_logprobs": 0, "temperature": 0.0,
                       "ignore_eos": True},
        "scored-n": {"prompt_token_ids": prompts["mid"], "max_tokens": 4, "prompt_logprobs": 1, "n": 2,
                     "temperature": 0.0, "ignore_eos": True},
    }
    results = run(engine, first, joining)
    for name in ("short", "long", "mid"):
        only = results[f"only-{name}"]
        check(only, model, prompts[name], 3)
        assert only.choices[0].token_ids == [] and only.choices[0].finish_reason == "length"
        assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(prompts[name])
    check(results["scored-gen"], model, prompts["gen"], 0)
    check(results["scored-n"], model, prompts["mid"], 1)
    # generating after the scoring prefill: the tokens the same request gives alone
    assert results["scored-gen"].choices[0].token_ids == reference(prompts["gen"], 5, ignore_eos=True)[0]
    assert [c.token_ids for c in results["scored-n"].choices] == [reference(prompts["mid"], 4, ignore_eos=True)[0]] * 2
    assert results["decoding"].choices[0].token_ids == reference(tokenizer.encode("Redis keeps the queue"), 24,
                                                                 ignore_eos=True)[0]


def test_a_one_token_prompt_has_nothing_to_score(engine: Any) -> None:
    results = run(engine, {"one": {"prompt_token_ids": [7], "max_tokens": 0, "prompt_logprobs": 2},
                           "one-gen": {"prompt_token_ids": [7], "max_tokens": 2, "prompt_logprobs": 0}}, {})
    assert results["one"].prompt_logprobs.logprobs == [None]  # type: ignore[union-attr]
    assert results["one"].prompt_logprobs.top_logprobs == [[]]  # type: ignore[union-attr]
    assert results["one-gen"].prompt_logprobs.logprobs == [None] and len(results["one-gen"].choices[0].token_ids) >= 1  # type: ignore[union-attr]
