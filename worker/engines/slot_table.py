"""SlotTable: the compiled engine's slots (worker/engines/compiled.py): which sequence holds each
one, the per-layer KV buffers behind them (worker/engines/slot_cache.py), each slot's input token
for the next step, and the buffers' shape: bucketed, grown before a step writes past them, shrunk
with hysteresis, within the KV budget."""

from __future__ import annotations

from typing import Generic, Optional, Protocol, TypeVar

import mlx.core as mx

from worker.engines.decode_step import MIN_LENGTH_BUCKET, bucket, ladder
from worker.engines.slot_cache import KVLayout, SlotBuffers

# Buffers are padded past what the sequences need to the next bucket; when a budget is set and the
# padded shape would exceed it, lengths are rounded up to this many positions instead.
EXACT_LENGTH_STEP = 64


class Slotted(Protocol):
    slot: int
    position: int  # where its next input token's keys and values go


S = TypeVar("S", bound=Slotted)


class SlotTable(Generic[S]):
    def __init__(self, layout: KVLayout, max_slots: int, kv_budget_bytes: int = 0) -> None:
        self._layout = layout
        self._max_slots = max_slots
        self._kv_budget = kv_budget_bytes
        self.buffers: Optional[SlotBuffers] = None
        self.slots: list[Optional[S]] = []
        self.inputs: Optional[mx.array] = None  # (slots,): each slot's token for the next step

    def occupied(self) -> list[S]:
        return [s for s in self.slots if s is not None]

    def any_occupied(self) -> bool:
        return any(s is not None for s in self.slots)

    @property
    def free(self) -> int:
        """Sequences that could still take a slot (up to max_num_seqs)."""
        return self._max_slots - sum(1 for s in self.slots if s is not None)

    def ladder(self) -> list[int]:
        """Every slot bucket up to max_num_seqs."""
        return sorted({min(b, self._max_slots) for b in ladder(self._max_slots)})

    def shape_for(self, rows: int, tokens: int) -> tuple[int, int]:
        """The buffer shape that holds `rows` sequences of `tokens` positions: both bucketed, or,
        when that exceeds the KV budget, the rows exactly and the length in EXACT_LENGTH_STEPs."""
        slots = min(bucket(rows), self._max_slots)
        length = bucket(tokens, MIN_LENGTH_BUCKET)
        if self._kv_budget and slots * length * self._layout.bytes_per_token > self._kv_budget:
            slots, length = rows, -(-tokens // EXACT_LENGTH_STEP) * EXACT_LENGTH_STEP
        return slots, length

    def place(self, seq: S) -> None:
        """Give `seq` the first free slot (`reserve` made room)."""
        seq.slot = next(i for i, s in enumerate(self.slots) if s is None)
        self.slots[seq.slot] = seq

    def vacate(self, seq: S) -> None:
        if 0 <= seq.slot < len(self.slots) and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None

    def release(self) -> None:
        """No sequence left: give the buffers' memory back."""
        self.buffers, self.slots, self.inputs = None, [], None

    def reserve(self, rows: int, tokens: int) -> None:
        """Make room for `rows` more sequences of up to `tokens` positions."""
        occupied = sum(1 for s in self.slots if s is not None)
        need_rows, need_length = occupied + rows, max(tokens, self._needed_length())
        if self.buffers is not None and need_rows <= len(self.slots) and need_length <= self.buffers.length:
            return
        self._resize(*self.shape_for(need_rows, need_length))

    def fit(self, waiting: bool, ahead: int = 0) -> None:
        """Before a step: grow the buffers for the positions it writes (`ahead` more than one per
        slot: a verification pass); shrink them once the sequences need half of them or less (the
        hysteresis keeps churn from resizing every step), the slots only while nothing is `waiting`
        for one."""
        if self.buffers is None:
            return
        occupied = sum(1 for s in self.slots if s is not None)
        needed = self._needed_length() + ahead
        slots, length = self.shape_for(occupied, needed)
        target = (len(self.slots) if waiting or slots > len(self.slots) // 2 else slots,
                  self.buffers.length if length > self.buffers.length // 2 and needed <= self.buffers.length
                  else length)
        if self._kv_budget and target[0] * target[1] * self._layout.bytes_per_token > self._kv_budget:
            target = (slots, length)
        if target != (len(self.slots), self.buffers.length):
            self._resize(*target)

    def _needed_length(self) -> int:
        """Positions the next step writes up to (each slot's position, plus one)."""
        return max((s.position + 1 for s in self.slots if s is not None), default=1)

    def _resize(self, slots: int, length: int) -> None:
        """New buffers of `slots x length`; the occupied slots move to the first ones, in order."""
        keep = [s for s in self.slots if s is not None]
        if self.buffers is None:
            self.buffers = SlotBuffers.allocate(self._layout, slots, length)
        else:
            self.buffers = self.buffers.resized(slots, length, [s.slot for s in keep])
        inputs = mx.zeros((slots,), dtype=mx.uint32)
        if keep and self.inputs is not None:
            inputs[: len(keep)] = self.inputs[mx.array([s.slot for s in keep], dtype=mx.int32)]
        self.inputs = inputs
        for i, seq in enumerate(keep):
            seq.slot = i
        self.slots = keep + [None] * (slots - len(keep))
