"""Per-request sampling inside one batch.

Each sequence gets its own logits processors and a sampler chosen by its settings:
- greedy rows share one argmax sampler, and unseeded rows with equal settings share one
  mlx-lm sampler, so mlx-lm samples them in one call when the whole batch agrees;
- a seeded row gets its own sampler that draws token k of choice i with the key
  `key(mix(seed, i, k))`: the same ids alone, in any batch, on any worker, after restarts.

Distributions (what `logprobs_mode` selects):
- "raw": log-softmax of the model's logits, before any processing;
- "processed": the distribution the token was actually drawn from: after logit_bias and
  penalties, temperature, then top-p / min-p / top-k, renormalized (greedy rows: no temperature).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from worker.engines.base import SamplingParams

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]

_MASK64 = (1 << 64) - 1


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def mix_seed(seed: int, choice: int, step: int) -> int:
    """splitmix64 over (seed, choice, step): independent, reproducible keys without RNG state."""
    z = (seed * 0x9E3779B97F4A7C15 + choice * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def truncate(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """top-p, min-p, top-k (mlx-lm's filters, in mlx-lm's order): excluded tokens become -inf."""
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def processed_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The sampling distribution, given the (already processed) log-softmax rows."""
    scores = truncate(logprobs, params)
    if not params.is_greedy:
        scores = scores * (1.0 / params.temperature)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


class SamplerPool:
    """Hands out samplers, sharing one object between rows whose settings make them interchangeable."""

    def __init__(self) -> None:
        self._shared: dict[SamplingParams, Sampler] = {}

    def get(self, params: SamplingParams, choice: int) -> Sampler:
        if params.is_greedy:
            return greedy
        if params.seed is not None:
            return _seeded_sampler(params, choice)
        key = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                             min_p=params.min_p)
        if key not in self._shared:
            sampler = make_sampler(
                temp=key.temperature, top_p=key.top_p if key.top_p < 1.0 else 0.0, min_p=key.min_p, top_k=key.top_k
            )
            sampler.shared = True  # type: ignore[attr-defined]
            self._shared[key] = sampler
        return self._shared[key]


def _seeded_sampler(params: SamplingParams, choice: int) -> Sampler:
    assert params.seed is not None
    seed, inv_temp = params.seed, 1.0 / params.temperature
    step = 0

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal step
        key = mx.random.key(mix_seed(seed, choice, step))
        step += 1
        return mx.random.categorical(truncate(logprobs, params) * inv_temp, key=key)

    return sample


def has_processors(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or bool(
        params.presence_penalty or params.frequency_penalty
    )


def logits_processors(
    params: SamplingParams, prompt_len: int, capture: Optional[Processor] = None
) -> list[Processor]:
    """Processors for one row. `capture` (if given) runs first and sees the raw logits.

    The token context mlx-lm passes holds the prompt then the generated tokens.
    Penalties follow the usual definitions rather than mlx-lm's last-20-tokens window:
    repetition (multiplicative, CTRL/HF) over prompt and output; presence and frequency
    (additive, OpenAI) over the output only.
    """
    processors: list[Processor] = [capture] if capture is not None else []
    if params.logit_bias:
        processors += make_logits_processors(logit_bias=dict(params.logit_bias))
    if params.repetition_penalty != 1.0:
        processors.append(_repetition_penalty(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(_openai_penalties(params.presence_penalty, params.frequency_penalty, prompt_len))
    return processors


def _repetition_penalty(penalty: float) -> Processor:
    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        seen = mx.zeros((logits.shape[-1],), dtype=mx.int32).at[tokens].add(1) > 0
        penalized = mx.where(logits < 0, logits * penalty, logits / penalty)
        return mx.where(seen, penalized, logits)

    return apply


def _openai_penalties(presence: float, frequency: float, prompt_len: int) -> Processor:
    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens[prompt_len:]
        if generated.size == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), dtype=logits.dtype).at[generated].add(1)
        return logits - counts * frequency - (counts > 0).astype(logits.dtype) * presence

    return apply
