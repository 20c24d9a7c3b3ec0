"""The text engine's rows: one sequence's own state in mlx-lm's batch, and how it samples.

Each row has its own sampler (shared between rows whose settings make them interchangeable,
worker/engines/sampling.py `SamplerPool`) and logits processors, each guarded so that its failure
ends that row alone; a constrained row's matcher masks its logits (worker/engines/constraints.py).
Rows prefilled at admission (worker/engines/text.py `_start_now`) sample their first token here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from worker.engines.base import SequenceSpec, TokenEvent
from worker.engines.constraints import CompiledConstraint, MaskBatch, RowConstraint, fenced, finish_token
from worker.engines.sampling import (RawLogits, RowGuard, SamplerPool, attach_logprobs, logits_processors,
                                     needs_raw_capture, requested_distribution)


@dataclass
class Row:
    """One sequence's own state in the batch: its spec, sampler, processors and their guard."""

    spec: SequenceSpec
    capture: Optional[RawLogits]
    guard: RowGuard
    sampler: Any
    processors: list[Any]
    constraint: Optional[RowConstraint] = None
    emitted: bool = False  # it has produced a token
    version: int = 0  # of the weights when it was made: a cache it leaves is that version's only if unchanged

    @property
    def error(self) -> Optional[str]:
        """What failed in this row's own code (a processor, its sampler, its matcher), if anything."""
        return self.guard.error or (self.constraint.error if self.constraint is not None else None)


class RowMaker:
    """Makes the rows, and owns what they share: the sampler pool and the constrained rows' masks."""

    def __init__(self, vocab_size: int, max_num_seqs: int) -> None:
        self._vocab_size = vocab_size
        self._max_num_seqs = max_num_seqs
        self.reset()

    def reset(self) -> None:
        """Forget every row: a new sampler pool (its samplers fill the masks first) and no masks."""
        self._samplers = SamplerPool(fence=lambda sampler: fenced(sampler, self._fill_masks))
        self._masks: Optional[MaskBatch] = None  # made with the first constrained row

    def row(self, spec: SequenceSpec, version: int) -> Row:
        """A sequence's own sampler and logits processors, each guarded so that its failure ends
        that sequence alone."""
        constraint = None
        if isinstance(spec.inputs, CompiledConstraint):
            constraint = RowConstraint(spec.inputs, len(spec.prompt_token_ids), self._mask_batch())
        capture = RawLogits() if needs_raw_capture(spec, constraint is not None) else None
        guard = RowGuard()
        sampler, namer = self._samplers.get(spec.sampling, spec.choice_index)
        processors = [guard.processor(p) for p in
                      logits_processors(spec.sampling, len(spec.prompt_token_ids), capture, constraint)]
        if namer is not None:  # unguarded: it must run even after another processor of the row failed
            processors.insert(0, namer)
        return Row(spec, capture, guard, guard.sampler(sampler), processors, constraint, version=version)

    def _mask_batch(self) -> MaskBatch:
        if self._masks is None:
            self._masks = MaskBatch(self._vocab_size, 2 * self._max_num_seqs)
        return self._masks

    def _fill_masks(self) -> None:
        if self._masks is not None:
            self._masks.fill()

    def begin_step(self) -> None:
        """Before each sampling call of the batch (mlx-lm's, or `first_tokens`)."""
        self._samplers.seeded.begin()
        if self._masks is not None:
            self._masks.begin_step()

    def first_tokens(self, rows: list[Row], logits: mx.array, context: mx.array, stream: Any, version: int
                     ) -> tuple[list[TokenEvent], list[tuple[Row, int]]]:
        """Each row's first token from its prompt's last `logits`, sampled on `stream` as mlx-lm
        samples (the processors on the tokens so far, the log-softmax, the sampler): every row's
        event, and the rows that go on, with their first token."""
        self.begin_step()
        sampled = []
        with mx.stream(stream):
            for row in rows:
                row_logits = logits
                for processor in row.processors:  # as mlx-lm calls them: the tokens so far, then the logits
                    row_logits = processor(context, row_logits)
                logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                sampled.append((logprobs, row.sampler(logprobs)))
            mx.eval([token for _, token in sampled])
        events, wanted, going_on = [], [], []
        for row, (logprobs, token) in zip(rows, sampled):
            spec = row.spec
            raw_logits = row.capture.pending.popleft() if row.capture is not None and row.capture.pending else None
            error = row.error
            if error is not None:
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=error))
                if row.constraint is not None:
                    row.constraint.release()
                continue
            first = int(token.item())
            finish = "stop" if first in spec.stop_token_ids else "length" if spec.max_tokens <= 1 else None
            event = finish_token(row.constraint, TokenEvent(uid=spec.uid, token=first, index=spec.choice_index,
                                                            finish_reason=finish, weight_version=version))
            if finish is not None and row.constraint is not None:
                row.constraint.release()
            events.append(event)
            if event.error is not None:
                continue
            if spec.logprobs or spec.top_logprobs:
                wanted.append((event, spec, requested_distribution(spec, logprobs[0], raw_logits)))
            if finish is None:
                row.emitted = True
                going_on.append((row, first))
        if wanted:
            attach_logprobs(wanted)
        return events, going_on
