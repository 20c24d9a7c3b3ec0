"""One decode step's sampling for the compiled engine's rows (worker/engines/compiled.py).

Each row's logits processors (logit_bias, penalties), then the structured-output masks of every
constrained row in one operation (worker/engines/constraints.py `MaskBatch.masked_rows`), the
log-softmax, the samplers (rows that share one sampler object in one call) and the logprobs the
rows asked for: mlx-lm's order, with the text engine's per-row rules (worker/engines/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import mlx.core as mx

from worker.engines.base import SequenceSpec
from worker.engines.constraints import CompiledConstraint, MaskBatch, RowConstraint, fenced
from worker.engines.sampling import (LogprobGather, RowGuard, SamplerPool, SeededRow, logits_processors,
                                     needs_raw_capture, reads_probabilities, requested_distribution)

if TYPE_CHECKING:
    from worker.engines.compiled_rows import DecodingSequence


@dataclass
class SequenceSampling:
    """What a sequence samples with: its guard, sampler and processors, its constraint."""

    guard: RowGuard
    sampler: Any
    processors: list[Any]
    constraint: Optional[RowConstraint]
    custom: bool  # it has processors that change its logits (beyond naming a seeded row)
    seeded: bool  # sampled by the seeded sampler, which takes exactly the rows it has names for
    seeded_row: Optional[SeededRow] = None  # a seeded row's key counter (speculative verification reads it)


class StepSampler:
    def __init__(self, vocab_size: int, max_slots: int) -> None:
        self._vocab_size = vocab_size
        self._max_slots = max_slots
        self._samplers = SamplerPool(fence=lambda sampler: fenced(sampler, self._fill_masks))
        self._masks: Optional[MaskBatch] = None  # made with the first constrained row
        self._no_tokens = mx.array([], dtype=mx.int32)

    def row(self, spec: SequenceSpec) -> SequenceSampling:
        """A sequence's sampler and processors, each guarded so that its failure ends that sequence
        alone (as the text engine's rows)."""
        constraint = None
        if isinstance(spec.inputs, CompiledConstraint):
            constraint = RowConstraint(spec.inputs, len(spec.prompt_token_ids), self._mask_batch())
        # With deferred masks every constrained row of a step is masked in one operation (`sample`);
        # otherwise the constraint is the row's own last processor.
        batched = constraint is not None and constraint.batched
        guard = RowGuard()
        sampler, namer = self._samplers.get(spec.sampling, spec.choice_index)
        processors = [guard.processor(p) for p in
                      logits_processors(spec.sampling, len(spec.prompt_token_ids), None,
                                        None if batched else constraint)]
        custom = bool(processors)
        if namer is not None:  # unguarded: it must run even after another processor of the row failed
            processors.insert(0, namer)
        return SequenceSampling(guard, guard.sampler(sampler), processors, constraint, custom, seeded=namer is not None,
                                seeded_row=namer.row if namer is not None else None)

    def _mask_batch(self) -> MaskBatch:
        if self._masks is None:
            self._masks = MaskBatch(self._vocab_size, 2 * self._max_slots)
        return self._masks

    def _fill_masks(self) -> None:
        if self._masks is not None:
            self._masks.fill()

    def begin(self, occupied: Sequence["DecodingSequence"], inputs: mx.array) -> None:
        """Before a step is built: its constrained rows' matchers start taking the tokens fed to it and
        computing their masks (worker/engines/constraints.py `MaskBatch.expect`), so that the work
        overlaps with building the step. Each step calls it, then `sample`."""
        self._samplers.seeded.begin()
        if self._masks is None:
            return
        self._masks.begin_step()
        # After its first decode step, the token a row is fed is the one its matcher has not seen.
        constrained = [(seq.constraint, seq.slot if seq.launches else None) for seq in occupied
                       if seq.constraint is not None and seq.constraint.batched]
        if constrained:
            self._masks.expect(constrained, inputs)

    def sample(self, logits: mx.array, inputs: mx.array, occupied: Sequence["DecodingSequence"], slot_count: int,
               rows: Optional[list[int]] = None) -> tuple[mx.array, Optional[LogprobGather], list[int]]:
        """Each row's processors, then its sampler (rows sharing one sampler in one call), and the
        logprobs of the rows that asked: mlx-lm's order (processors, log-softmax, sampler). The step
        was begun (`begin`) with the same rows and inputs. Each sequence's row of `logits` and
        `inputs` is its slot, or its entry of `rows`."""
        rows = [seq.slot for seq in occupied] if rows is None else rows
        processed = logits
        changed: list[tuple[int, mx.array]] = []
        masked: list[tuple[RowConstraint, int, Optional[mx.array]]] = []
        for seq, slot in zip(occupied, rows):
            constrained = seq.constraint is not None and seq.constraint.batched
            if not seq.processors and not constrained:
                continue
            context = self._no_tokens
            if seq.custom:
                assert seq.context is not None
                if seq.launches:  # the token it is fed now joins its context
                    seq.context = mx.concatenate([seq.context, inputs[slot:slot + 1].astype(mx.int32)])
                context = seq.context
            row_logits = None
            if seq.processors:
                row_logits = logits[slot:slot + 1]
                for processor in seq.processors:
                    row_logits = processor(context, row_logits)
            if constrained:
                assert seq.constraint is not None
                masked.append((seq.constraint, slot, row_logits))
            elif seq.custom:
                assert row_logits is not None
                changed.append((slot, row_logits))
        if changed:
            processed = _put_rows(processed, [slot for slot, _ in changed], mx.concatenate([row for _, row in changed]))
        if masked:
            assert self._masks is not None
            self._masks.launch(logits)  # handed to the device by the fill, while the masks are finished
            slots = [slot for _, slot, _ in masked]
            if all(row is None for *_, row in masked):
                block = logits[mx.array(slots, dtype=mx.int32)]
            else:
                block = mx.concatenate([logits[slot:slot + 1] if row is None else row for _, slot, row in masked])
            block = self._masks.masked_rows([constraint for constraint, _, _ in masked], block)
            processed = _put_rows(processed, slots, block)
        logprobs = processed - mx.logsumexp(processed, axis=-1, keepdims=True)  # lazy: computed where read
        tokens = self._draw(processed, logprobs, occupied, rows, slot_count)
        wanting = [i for i, seq in enumerate(occupied) if seq.spec.logprobs or seq.spec.top_logprobs]
        if not wanting:
            return tokens, None, wanting
        specs = [occupied[i].spec for i in wanting]
        slots = [rows[i] for i in wanting]
        index = mx.array(slots, dtype=mx.int32)
        raw = [needs_raw_capture(occupied[i].spec, occupied[i].constraint is not None) for i in wanting]
        if not any(raw) and all(s.logprobs_mode == "raw" for s in specs):
            distributions = logprobs[index]
        else:
            distributions = mx.stack([requested_distribution(spec, logprobs[slot], logits[slot] if keep else None)
                                      for spec, slot, keep in zip(specs, slots, raw)])
        return tokens, LogprobGather(distributions, tokens[index], [s.top_logprobs for s in specs]), wanting

    def _draw(self, processed: mx.array, logprobs: mx.array, occupied: Sequence["DecodingSequence"], rows: list[int],
              slot_count: int) -> mx.array:
        """One token per slot: each group of rows that shares a sampler object is sampled in one
        call. One shared, unseeded group samples every slot at once (free slots' tokens are never
        read); the others sample their own rows, in slot order. Only samplers that read
        probabilities are given the log-softmax; the others take the processed logits, a row's
        constant away (sampling.py `reads_probabilities`)."""
        groups: dict[int, _SamplerGroup] = {}
        for seq, slot in zip(occupied, rows):
            group = groups.setdefault(id(seq.sampler), _SamplerGroup(seq.sampler, [], seq.seeded,
                                                                     reads_probabilities(seq.spec.sampling)))
            group.slots.append(slot)
        base = next((g for g in groups.values() if getattr(g.sampler, "shared", False) and not g.seeded), None)
        tokens = (base.sampler(logprobs if base.reads_probabilities else processed) if base is not None
                  else mx.zeros((slot_count,))).astype(mx.uint32)
        for group in groups.values():
            if group is base:
                continue
            index = mx.array(group.slots, dtype=mx.int32)
            drawn = group.sampler((logprobs if group.reads_probabilities else processed)[index]).astype(mx.uint32)
            tokens = mx.put_along_axis(tokens, index, drawn, axis=0)
        return tokens


class _SamplerGroup(NamedTuple):
    """The rows of a step that share one sampler object."""

    sampler: Any
    slots: list[int]
    seeded: bool
    reads_probabilities: bool


def _put_rows(logits: mx.array, slots: list[int], rows: mx.array) -> mx.array:
    """`logits` with the rows at `slots` replaced by `rows`."""
    where = mx.array(slots, dtype=mx.int32)[:, None]
    return mx.put_along_axis(logits, mx.broadcast_to(where, rows.shape), rows, axis=0)
