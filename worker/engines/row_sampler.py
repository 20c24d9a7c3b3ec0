"""One sampler for a whole batch whose rows each sample by their own settings.

mlx-vlm's BatchGenerator takes one sampler for the batch (mlx-lm's takes one per row). Per-row
sampling rides on per-row processors, as worker/engines/sampling.py's SeededSampler does for the
text engine's seeded rows: each row's first processor names the row to this sampler (`RowNames`).
Each row is then sampled as it would be alone: greedy rows by argmax, seeded rows by `draw_seeded`
(the same ids alone, in any batch, on any worker), the others by mlx-lm's sampler for their
settings (one call per group of equal settings).
Where a row asked for logprobs, the distribution each of its tokens was drawn from is kept for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from worker.engines.base import SamplingParams
from worker.engines.sampling import Namer, RowNames, SamplerPool, SeededRow, draw_seeded, greedy


@dataclass
class SampledRow:
    """One row as this sampler sees it."""

    seeded: Optional[SeededRow]  # set for a seeded row
    sampler: Any  # greedy or a shared mlx-lm sampler (unseeded rows)
    keep_distributions: bool = False
    # The (vocab,) log-probabilities (after the row's processors) each sampled token was drawn from,
    # oldest first: the generator returns a token one step after sampling it.
    drawn_from: deque[mx.array] = field(default_factory=deque)


class RowSampler:
    def __init__(self) -> None:
        self._pool = SamplerPool()
        self._names: RowNames[SampledRow] = RowNames()

    def row(self, params: SamplingParams, choice: int, keep_distributions: bool) -> tuple[SampledRow, Namer]:
        """A row's state here and the processor that names it (it must run whatever the row's
        other processors do)."""
        if params.seed is not None and not params.is_greedy:
            row = SampledRow(SeededRow(params, choice), None, keep_distributions)
        else:
            row = SampledRow(None, self._pool.get(params, choice)[0], keep_distributions)
        return row, self._names.namer(row)

    def begin(self) -> None:
        """Before a step: names left by a step that failed halfway belong to no call."""
        self._names.clear()

    def __call__(self, logprobs: mx.array) -> mx.array:
        rows = self._names.take(logprobs.shape[0])
        for i, row in enumerate(rows):
            if row.keep_distributions:
                row.drawn_from.append(logprobs[i])
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(id(row.sampler), []).append(i)
        if len(groups) == 1:
            return _sample(logprobs, rows)
        order = [i for members in groups.values() for i in members]
        parts = [_sample(logprobs[mx.array(members)], [rows[i] for i in members]) for members in groups.values()]
        return mx.concatenate([part.astype(mx.uint32) for part in parts])[mx.argsort(mx.array(order))]


def _sample(logprobs: mx.array, rows: list[SampledRow]) -> mx.array:
    """Rows that share one way of sampling (all seeded, all greedy, or one mlx-lm sampler)."""
    if rows[0].seeded is not None:
        return draw_seeded(logprobs, [row.seeded for row in rows if row.seeded is not None])
    sampler = rows[0].sampler
    return greedy(logprobs) if sampler is greedy else sampler(logprobs)
