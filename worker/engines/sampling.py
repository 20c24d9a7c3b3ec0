"""Per-request sampling inside one batch.

Each sequence gets its own logits processors and a sampler chosen by its settings:
- greedy rows share one argmax sampler, and unseeded rows with equal settings share one
  mlx-lm sampler, so mlx-lm samples them in one call when the whole batch agrees;
- seeded rows share one `SeededSampler`, which draws token k of choice i by inverse CDF from one
  uniform under the key `key(mix(seed, i, k))`: the same ids alone, in any batch, on any worker,
  after restarts, and in one call for a whole batch of seeded rows.

Distributions (what `logprobs_mode` selects):
- "raw": log-softmax of the model's logits, before any processing;
- "processed": the distribution the token was actually drawn from: after logit_bias and
  penalties, temperature, then top-p / min-p / top-k, renormalized (greedy rows: no temperature).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from worker.engines.base import SamplingParams

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]

_MASK64 = (1 << 64) - 1


def repair_random_state() -> None:
    """Give MLX's global generator a fresh key. mlx-lm's samplers are compiled with that state as
    an input and output: a step that raised inside one left it an array without a value, and every
    unseeded sampled row on the worker failed to evaluate afterwards."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


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
    """Hands out samplers, sharing one object between rows whose settings make them interchangeable.
    `fence` (if given) wraps each sampler once: it runs before every sampling call (the constrained
    rows' masks are filled there, worker/engines/constraints.py)."""

    def __init__(self, fence: Optional[Callable[[Sampler], Sampler]] = None) -> None:
        self._shared: dict[SamplingParams, Sampler] = {}
        self.seeded = SeededSampler()
        self._fence = fence
        self._greedy = greedy if fence is None else fence(greedy)
        self._seeded = self.seeded if fence is None else fence(self.seeded)

    def get(self, params: SamplingParams, choice: int) -> tuple[Sampler, Optional[Processor]]:
        """The row's sampler and, for a seeded row, the processor that names the row to it (it
        must run whatever the row's other processors do)."""
        if params.is_greedy:
            return self._greedy, None
        if params.seed is not None:
            return self._seeded, self.seeded.name_row(params, choice)
        key = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                             min_p=params.min_p)
        if key not in self._shared:
            sampler = make_sampler(
                temp=key.temperature, top_p=key.top_p if key.top_p < 1.0 else 0.0, min_p=key.min_p, top_k=key.top_k
            )
            sampler.shared = True  # type: ignore[attr-defined]
            self._shared[key] = sampler if self._fence is None else self._fence(sampler)
        return self._shared[key], None


@dataclass
class _SeededRow:
    params: SamplingParams
    choice: int
    drawn: int = 0  # tokens drawn so far

    def next_key(self) -> int:
        assert self.params.seed is not None
        key = mix_seed(self.params.seed, self.choice, self.drawn)
        self.drawn += 1
        return key


class SeededSampler:
    """The one sampler of every seeded row, so that mlx-lm samples a batch of them in one call.

    With a sampler per row, mlx-lm sampled row by row, a dozen small array operations each: on an
    H200 a decode step of 256 seeded rows took 54-65 ms against 8-9 ms unseeded (now ~16). Shared,
    it gets a batch's log-probabilities in one call but not which rows they are, so each seeded row
    also carries a processor that names it here: mlx-lm runs every row's processors, in batch order,
    before it samples them. A call takes as many names as it has rows, oldest first (a batch that
    mixes seeded rows with others is sampled row by row: one name a call).

    Token k of choice i is the one MLX's `random.categorical` draws from that row alone under the
    key `key(mix_seed(seed, i, k))`: the inverse CDF of exp(x - max) at one uniform draw."""

    shared = True  # one object for every row: _RowGuard leaves it unwrapped

    def __init__(self) -> None:
        self._named: list[_SeededRow] = []

    def name_row(self, params: SamplingParams, choice: int) -> Processor:
        row = _SeededRow(params, choice)

        def name(tokens: mx.array, logits: mx.array) -> mx.array:
            self._named.append(row)
            return logits

        return name

    def begin(self) -> None:
        """Before a step: names left by a step that failed halfway belong to no call."""
        self._named.clear()

    def __call__(self, logprobs: mx.array) -> mx.array:
        count = logprobs.shape[0]
        if len(self._named) < count:
            raise RuntimeError(f"seeded sampling: {count} rows to sample but {len(self._named)} named; this "
                               "mlx-lm does not run each row's processors before sampling, as 0.32 does")
        rows, self._named = self._named[:count], self._named[count:]
        scores = _truncated_and_scaled(logprobs, [row.params for row in rows])
        keys = mx.array([[key >> 32, key & 0xFFFFFFFF] for key in (row.next_key() for row in rows)],
                        dtype=mx.uint32)
        uniform = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))(keys)
        return _inverse_cdf(scores, uniform)


def _truncated_and_scaled(logprobs: mx.array, params: list[SamplingParams]) -> mx.array:
    """Each row truncated by its own top-p / min-p / top-k, then divided by its temperature."""
    groups: dict[tuple[float, float, int], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.top_p, p.min_p, p.top_k), []).append(i)
    if len(groups) == 1:
        truncated = truncate(logprobs, params[0])
    else:
        order = [i for rows in groups.values() for i in rows]
        parts = [truncate(logprobs[mx.array(rows)], params[rows[0]]) for rows in groups.values()]
        truncated = mx.concatenate(parts)[mx.argsort(mx.array(order))]
    inv_temps = mx.array([1.0 / p.temperature for p in params], dtype=truncated.dtype)
    return truncated * inv_temps[:, None]


def _inverse_cdf(scores: mx.array, uniform: mx.array) -> mx.array:
    """Per row, where `uniform` (n, 1) falls in the CDF of exp(scores - max): what MLX's
    `random.categorical` computes for one distribution (a row of -inf is uniform over its entries)."""
    x = scores.astype(mx.float32)  # as MLX promotes bfloat16 and float16 logits
    peak = x.max(axis=-1, keepdims=True)
    weights = mx.where(mx.isinf(peak), (x == peak).astype(x.dtype), mx.exp(x - peak))
    cdf = mx.cumsum(weights, axis=-1, inclusive=False)
    target = uniform * weights.sum(axis=-1, keepdims=True)
    return ((cdf <= target).sum(axis=-1) - 1).astype(mx.uint32)


def has_processors(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or bool(
        params.presence_penalty or params.frequency_penalty
    )


def logits_processors(
    params: SamplingParams, prompt_len: int, capture: Optional[Processor] = None,
    constraint: Optional[Processor] = None,
) -> list[Processor]:
    """Processors for one row. `capture` (if given) runs first and sees the raw logits; `constraint`
    (a structured-output mask) runs last, so the processed distribution is the masked one.

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
    if constraint is not None:
        processors.append(constraint)
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
