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

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from worker.engines.base import SamplingParams, SequenceSpec, TokenEvent
from worker.platform import exp_through_power

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


def exp(x: mx.array) -> mx.array:
    """e**x by the faster of MLX's two ways here (worker/platform.py `exp_through_power`): the
    inverse CDF of a sampled row computes one per vocabulary entry."""
    if exp_through_power(mx.default_device() == mx.cpu):
        return mx.power(math.e, x)
    return mx.exp(x)


def reads_probabilities(params: SamplingParams) -> bool:
    """Whether a row's sampler must be given log-probabilities rather than its logits. The argmax,
    the draws, min-p and top-k do not change when a row's scores move by a constant, so for most
    rows the log-softmax, one `exp` per vocabulary entry, can be spared; mlx-lm's top-p sums
    probabilities (the seeded sampler normalises such rows itself)."""
    return not params.is_greedy and params.seed is None and 0.0 < params.top_p < 1.0


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

    def get(self, params: SamplingParams, choice: int) -> tuple[Sampler, Optional["Namer"]]:
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
class SeededRow:
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

    With a sampler per row, mlx-lm samples row by row, a dozen small array operations each, which
    made seeded steps several times slower than unseeded ones (docs/design-notes.md). Shared, it gets
    a batch's log-probabilities in one call but not which rows they are, so each seeded row also carries
    a processor that names it here: mlx-lm runs every row's processors, in batch order, before it
    samples them. A call takes as many names as it has rows, oldest first (a batch that
    mixes seeded rows with others is sampled row by row: one name a call).

    Token k of choice i is the one MLX's `random.categorical` draws from that row alone under the
    key `key(mix_seed(seed, i, k))`: the inverse CDF of exp(x - max) at one uniform draw."""

    shared = True  # one object for every row: RowGuard leaves it unwrapped

    def __init__(self) -> None:
        self._names: RowNames[SeededRow] = RowNames()

    def name_row(self, params: SamplingParams, choice: int) -> "Namer":
        return self._names.namer(SeededRow(params, choice))

    def begin(self) -> None:
        """Before a step: names left by a step that failed halfway belong to no call."""
        self._names.clear()

    def __call__(self, logprobs: mx.array) -> mx.array:
        return draw_seeded(logprobs, self._names.take(logprobs.shape[0]))


RowT = TypeVar("RowT")


class RowNames(Generic[RowT]):
    """The rows a shared sampler's next call samples, in batch order. Each row's first logits
    processor (`namer`) names its row here; mlx-lm 0.32 and mlx-vlm 0.7 run every row's processors,
    in batch order, before they sample, so a call's rows are the names given since the last call,
    oldest first."""

    def __init__(self) -> None:
        self.pending: list[RowT] = []

    def namer(self, row: RowT) -> "Namer":
        return Namer(self.pending, row)

    def clear(self) -> None:
        self.pending.clear()

    def take(self, count: int) -> list[RowT]:
        if len(self.pending) < count:
            raise RuntimeError(f"{count} rows to sample but {len(self.pending)} named: this generator does not run "
                               "each row's processors before it samples, as mlx-lm 0.32 and mlx-vlm 0.7 do")
        rows = self.pending[:count]
        del self.pending[:count]  # in place: the namers hold this list
        return rows


class Namer:
    """A row's first logits processor: it names the row to its sampler and leaves the logits as they
    are. mlx-vlm calls `process_last_token` where a processor has one, sparing it the row's context."""

    def __init__(self, pending: list[Any], row: Any) -> None:
        self._pending = pending
        self._row = row

    @property
    def row(self) -> Any:
        """The row it names (a seeded row's `SeededRow`)."""
        return self._row

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self._pending.append(self._row)
        return logits

    def process_last_token(self, token: int, logits: mx.array) -> mx.array:
        self._pending.append(self._row)
        return logits


def draw_seeded(logprobs: mx.array, rows: list[SeededRow]) -> mx.array:
    """Row i's next token under its own key: the same draw alone or beside any other rows."""
    return draw_with_keys(logprobs, [row.params for row in rows], [row.next_key() for row in rows])


def draw_with_keys(scores: mx.array, params: list[SamplingParams], keys: list[int]) -> mx.array:
    """Row i's token under `params[i]` from the uniform of key `keys[i]` (a `mix_seed` value): the
    seeded sampler's draw, for a caller that picks the keys itself (speculative verification draws a
    seeded row's token k with the key it would have had without speculation). `scores` are each
    row's log-probabilities or its logits (see `reads_probabilities`)."""
    scores = _truncated_and_scaled(scores, params)
    pairs = mx.array([[key >> 32, key & 0xFFFFFFFF] for key in keys], dtype=mx.uint32)
    uniform = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))(pairs)
    return _inverse_cdf(scores, uniform)


def _truncated_and_scaled(scores: mx.array, params: list[SamplingParams]) -> mx.array:
    """Each row truncated by its own top-p / min-p / top-k, then divided by its temperature. Rows
    with top-p are normalised first: the other filters and the draw do not mind a row's constant."""
    groups: dict[tuple[float, float, int], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.top_p, p.min_p, p.top_k), []).append(i)

    def truncated_group(rows: mx.array, p: SamplingParams) -> mx.array:
        if 0.0 < p.top_p < 1.0:
            rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        return truncate(rows, p)

    if len(groups) == 1:
        truncated = truncated_group(scores, params[0])
    else:
        order = [i for rows in groups.values() for i in rows]
        parts = [truncated_group(scores[mx.array(rows)], params[rows[0]]) for rows in groups.values()]
        truncated = mx.concatenate(parts)[mx.argsort(mx.array(order))]
    inv_temps = mx.array([1.0 / p.temperature for p in params], dtype=truncated.dtype)
    return truncated * inv_temps[:, None]


def _inverse_cdf(scores: mx.array, uniform: mx.array) -> mx.array:
    """Per row, where `uniform` (n, 1) falls in the CDF of exp(scores - max): what MLX's
    `random.categorical` computes for one distribution (a row of -inf is uniform over its entries)."""
    x = scores.astype(mx.float32)  # as MLX promotes bfloat16 and float16 logits
    peak = x.max(axis=-1, keepdims=True)
    weights = mx.where(mx.isinf(peak), (x == peak).astype(x.dtype), exp(x - peak))
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


# --- a row's own callables and the logprobs it asked for (both engines) ---------------------
class RowGuard:
    """Wraps one row's own callables (its processors, its seeded sampler) so an exception in them
    ends that sequence only. Shared samplers (greedy, unseeded groups) are left unwrapped: wrapping
    would give each row its own object and cost mlx-lm its one-call sampling of the batch."""

    def __init__(self) -> None:
        self.error: Optional[str] = None

    def processor(self, fn: Any) -> Any:
        def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return fn(tokens, logits)
                except Exception as exc:
                    self.error = f"{type(exc).__name__} in a logits processor: {exc}"
            return logits

        return guarded

    def sampler(self, fn: Any) -> Any:
        if fn is greedy or getattr(fn, "shared", False):
            return fn

        def guarded(logprobs: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return fn(logprobs)
                except Exception as exc:
                    self.error = f"{type(exc).__name__} in the sampler: {exc}"
            return greedy(logprobs)

        return guarded


class RawLogits:
    """First logits processor of a row whose raw logprobs were asked for while other processors
    (bias, penalties) change the logits: it keeps the logits as the model produced them.
    mlx-lm and mlx-vlm call a row's processors once per sampled token, in order, and return each
    token one step after sampling it, so the oldest kept logits belong to the token being returned."""

    def __init__(self) -> None:
        self.pending: deque[mx.array] = deque()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.pending.append(logits)
        return logits


def needs_raw_capture(spec: SequenceSpec, constrained: bool = False) -> bool:
    """Whether a row's raw logits must be kept: it asked for raw (or scaled) logprobs and something
    (a bias, a penalty, a constraint's mask) changes its logits before sampling."""
    wants = spec.logprobs or spec.top_logprobs > 0
    return wants and spec.logprobs_mode in ("raw", "scaled") and (constrained or has_processors(spec.sampling))


def requested_distribution(spec: SequenceSpec, logprobs: mx.array, raw_logits: Optional[mx.array]) -> mx.array:
    """The row's log-distribution the request asked to see (`logprobs` are after its processors):
    `raw`, the model's own; `scaled`, the model's own at the row's temperature, untruncated (what RL
    trainers usually recompute); `processed`, the exact distribution that sampled the token."""
    if spec.logprobs_mode == "processed":
        return processed_logprobs(logprobs, spec.sampling)
    if raw_logits is not None:
        raw = raw_logits.reshape(-1).astype(mx.float32)
        raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    else:
        raw = logprobs
    if spec.logprobs_mode == "scaled" and not spec.sampling.is_greedy and spec.sampling.temperature != 1.0:
        scaled = raw.astype(mx.float32) * (1.0 / spec.sampling.temperature)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    return raw


class LogprobGather:
    """The chosen token's logprob and the top-k of every row that asked, built as one lazy graph:
    `arrays` are to be evaluated (with a step, or at once), then `fill` writes them into events."""

    def __init__(self, rows: mx.array, tokens: mx.array, top: list[int]) -> None:
        """`rows` (n, vocab): the distributions; `tokens` (n,): the sampled ones; `top`: each row's k."""
        self.top = top
        self.chosen = mx.take_along_axis(rows, tokens.reshape(-1, 1), axis=-1)[:, 0]
        self.arrays = [self.chosen]
        k = max(top)
        if k:
            candidates = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
            candidate_vals = mx.take_along_axis(rows, candidates, axis=-1)
            order = mx.argsort(-candidate_vals, axis=-1)
            self.arrays += [mx.take_along_axis(candidates, order, axis=-1),
                            mx.take_along_axis(candidate_vals, order, axis=-1)]

    def fill(self, events: list[Optional[TokenEvent]]) -> None:
        """`events[i]` is row i's event (None: it ended meanwhile)."""
        chosen = self.arrays[0].tolist()
        top_ids, top_vals = (self.arrays[1].tolist(), self.arrays[2].tolist()) if len(self.arrays) > 1 else ([], [])
        for i, event in enumerate(events):
            if event is None:
                continue
            event.logprob = float(chosen[i])
            if self.top[i]:
                event.top_logprobs = list(zip(top_ids[i][: self.top[i]], top_vals[i][: self.top[i]]))


def attach_logprobs(wanted: list[tuple[TokenEvent, SequenceSpec, mx.array]]) -> None:
    """Gather the chosen token's logprob (and the top-k) for every row that asked, in one eval."""
    gather = LogprobGather(mx.stack([logprobs for _, _, logprobs in wanted]),
                           mx.array([event.token for event, _, _ in wanted]),
                           [spec.top_logprobs for _, spec, _ in wanted])
    mx.eval(gather.arrays)
    gather.fill([event for event, _, _ in wanted])
