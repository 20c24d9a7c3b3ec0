"""A sequence's own sampling state in a batch, and the logprobs reported for it: shared by the
text engines (worker/engines/text.py on mlx-lm's BatchGenerator, worker/engines/compiled.py).

A row's processors and its own sampler are guarded so that an exception in them ends that
sequence alone. The distribution a request sees (`distribution`) follows its `logprobs_mode`
(worker/engines/sampling.py). The chosen token's logprob and the top-k are gathered for all rows
that asked in one graph (`LogprobGather`), which an engine can evaluate with its step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from worker.engines.base import SequenceSpec, TokenEvent
from worker.engines.constraints import RowConstraint
from worker.engines.sampling import greedy, has_processors, processed_logprobs


@dataclass
class Row:
    """One sequence's own state in the batch: its spec, sampler, processors and their guard."""

    spec: SequenceSpec
    capture: Optional["RawLogits"]
    guard: "RowGuard"
    sampler: Any
    processors: list[Any]
    constraint: Optional[RowConstraint] = None
    emitted: bool = False  # it has produced a token


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
    mlx-lm calls a row's processors once per sampled token, in order, and returns each token one
    step after sampling it, so the oldest kept logits belong to the token being returned."""

    def __init__(self) -> None:
        self.pending: deque[mx.array] = deque()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.pending.append(logits)
        return logits


def needs_raw_capture(spec: SequenceSpec, constrained: bool) -> bool:
    """Whether the row's raw logits must be kept apart from the processed ones it samples from."""
    wants = spec.logprobs or spec.top_logprobs > 0
    return wants and spec.logprobs_mode == "raw" and (constrained or has_processors(spec.sampling))


def note_constraint(row: Row, event: TokenEvent) -> None:
    """Tell a constrained row's matcher what it returned, and on its last token whether its text is complete."""
    if row.constraint is None:
        return
    row.constraint.observe(event.token)
    if event.finish_reason is not None:
        event.constraint_complete = row.constraint.ended(stopped_by_token=event.finish_reason == "stop")


def distribution(spec: SequenceSpec, logprobs: mx.array, raw_logits: Optional[mx.array]) -> mx.array:
    """The row's log-distribution the request asked to see (logprobs are after processors)."""
    if spec.logprobs_mode == "processed":
        return processed_logprobs(logprobs, spec.sampling)
    if raw_logits is not None:
        raw = raw_logits.reshape(-1).astype(mx.float32)
        return raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    return logprobs


class LogprobGather:
    """The chosen token's logprob and the top-k of every row that asked, built as one lazy graph:
    `arrays` are to be evaluated (with a step, or at once), then `fill` writes them into events."""

    def __init__(self, distributions: list[mx.array], tokens: mx.array, top: list[int]) -> None:
        rows = mx.stack(distributions)
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
    gather = LogprobGather([logprobs for _, _, logprobs in wanted], mx.array([event.token for event, _, _ in wanted]),
                           [spec.top_logprobs for _, spec, _ in wanted])
    mx.eval(gather.arrays)
    gather.fill([event for event, _, _ in wanted])
