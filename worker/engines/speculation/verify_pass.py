"""One verification pass of the compiled engine (worker/engines/compiled.py): every slot's input and
its proposal through the model at once (verify_step.py), position 0 of every row sampled by the
engine's step sampling and the proposed positions by verify.py, then each row keeps what the served
model confirms and the draw after it, never past max_tokens, a stop token or EOS. Its position moves
to the end of what it kept, which rolls the rejected tokens' keys and values back (they lie past
it, hidden by the mask, and are overwritten later); its input for the next step is its last token.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from worker.engines.base import TokenEvent
from worker.engines.lora import LoraBank
from worker.engines.slot_table import SlotTable
from worker.engines.speculation.speculator import Speculator, StepPlan
from worker.engines.speculation.verify import ExtraPositions, ExtraRow, accepted_count
from worker.engines.speculation.verify_step import VerifyStep
from worker.engines.step_sampling import StepSampler

Emit = Callable[[Any, int, int], TokenEvent]  # (sequence, token, weight version) -> its event; ends it if done
End = Callable[[Any], None]


class VerificationPass:
    def __init__(self, model: Any, grouped_mask: bool, lora: LoraBank, speculator: Speculator) -> None:
        self.speculator = speculator
        self._lora = lora
        self._verify = VerifyStep(model, grouped_mask, extra_inputs=lora.state)
        self._extra = ExtraPositions()

    @property
    def traced(self) -> bool:
        """Whether the last pass traced its shape first (worker/engines/speculation/verify_step.py)."""
        return self._verify.traced

    def warm_up(self, layout: Any, slots: int, length: int, widths: list[int]) -> None:
        """Compile the pass at each width for (`slots`, `length`) now (VerifyStep.warm_up)."""
        self._verify.warm_up(layout, slots, length, widths)

    def run(self, plan: StepPlan, table: SlotTable[Any], sampling: StepSampler, version: int, emit: Emit, end: End
            ) -> list[TokenEvent]:
        """The pass over every occupied slot of `table` (its buffers fit for `plan.width` positions
        more), read back at once: the events of every row, in slot order, several per row that kept
        proposed tokens."""
        assert table.buffers is not None and table.inputs is not None
        occupied = table.occupied()
        drafts = {id(r.seq): r.draft for r in plan.rows}
        padded = [[0] * (plan.width - 1) for _ in table.slots]
        positions = [0] * len(table.slots)
        adapter_slots = [0] * len(table.slots)
        for seq in occupied:
            draft = drafts.get(id(seq), [])
            padded[seq.slot][: len(draft)] = draft
            positions[seq.slot] = seq.position
            adapter_slots[seq.slot] = seq.adapter_slot
        inputs = table.inputs
        tokens = mx.concatenate([inputs[:, None].astype(mx.uint32), mx.array(padded, dtype=mx.uint32)], axis=1)
        table.buffers.check_room(positions, plan.width)
        sampling.begin(occupied, inputs)
        with self._lora.rows(adapter_slots):
            logits = self._verify(tokens, mx.array(positions, dtype=mx.int32), table.buffers)
        first, gather, wanting = sampling.sample(logits[:, 0, :], inputs, occupied, len(table.slots))
        errors = [seq.error for seq in occupied]
        extra_rows = [ExtraRow(r.seq, r.seq.slot, j, r.seq.seeded_row.drawn - 1 + j if r.seq.seeded_row else 0)
                      for r in plan.rows for j in range(1, len(r.draft) + 1)]
        extra = self._extra.sample(logits, extra_rows)
        mx.eval(first, extra.tokens, *(gather.arrays if gather is not None else ()),
                *(extra.logprobs.arrays if extra.logprobs is not None else ()), *table.buffers.arrays())
        self.speculator.steps += 1
        first_tokens, extra_tokens = first.tolist(), extra.tokens.tolist()
        extras_of: dict[int, list[int]] = {}
        for k, row in enumerate(extra_rows):
            extras_of.setdefault(id(row.seq), []).append(k)
        wanted_at = {row: i for i, row in enumerate(wanting)}
        extra_wanted_at = {row: i for i, row in enumerate(extra.wanting)}
        wanted_events: list[Optional[TokenEvent]] = [None] * len(wanting)
        extra_events: list[Optional[TokenEvent]] = [None] * len(extra.wanting)
        next_inputs = list(first_tokens)
        events: list[TokenEvent] = []
        for i, seq in enumerate(occupied):
            spec = seq.spec
            if errors[i] is not None:
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=errors[i]))
                end(seq)
                continue
            draft, mine = drafts.get(id(seq), []), extras_of.get(id(seq), [])
            sampled = [int(first_tokens[seq.slot])] + [int(extra_tokens[k]) for k in mine]
            kept = sampled[: accepted_count(draft, sampled) + 1]
            if draft:  # (before its tokens are emitted: a row that ends is forgotten)
                self.speculator.outcome(seq, len(draft), len(kept) - 1)
            seq.position += 1  # its input
            emitted: list[TokenEvent] = []
            for j, token in enumerate(kept):
                if j:
                    seq.position += 1  # the proposed token this one follows was fed and kept
                event = emit(seq, token, version)
                emitted.append(event)
                if event.error is None and j == 0 and i in wanted_at:
                    wanted_events[wanted_at[i]] = event
                elif event.error is None and j and mine[j - 1] in extra_wanted_at:
                    extra_events[extra_wanted_at[mine[j - 1]]] = event
                if seq.done:
                    break
            events += emitted
            if draft:
                emitted[0].speculation = (self.speculator.name, len(draft), len(emitted) - 1)
            seq.launches += 1
            if not seq.done:
                next_inputs[seq.slot] = kept[-1]
                if seq.seeded_row is not None:
                    seq.seeded_row.drawn += len(kept) - 1  # its keys go on from the last token kept
                if seq.custom and len(kept) > 1:
                    assert seq.context is not None
                    seq.context = mx.concatenate([seq.context, mx.array(kept[:-1], dtype=mx.int32)])
        table.inputs = mx.array(next_inputs, dtype=mx.uint32)
        if gather is not None:
            gather.fill(wanted_events)
        if extra.logprobs is not None:
            extra.logprobs.fill(extra_events)
        return events

