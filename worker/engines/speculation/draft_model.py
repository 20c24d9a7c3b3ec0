"""The draft-model drafter (`--speculative draft --draft-model PATH`): a smaller model of the same
tokenizer proposes each row's next k tokens, greedily (its argmax: a deterministic proposal, which
verification treats as a point mass, worker/engines/speculation/verify.py).

Every row keeps its draft keys and values in a slot of the draft model's own slot buffers (the
compiled engine's, worker/engines/slot_cache.py, in a `SlotTable`: bucketed shapes, grown before
a call writes past them, shrunk with hysteresis), together with the tokens the slot holds. The
draft model runs as one batched call per position over every slot, each slot at its own position:

1. Each asking row keeps the longest prefix its slot shares with the row's tokens now (at least
   its last token is run again): moving the row's position back to it rolls the rejected
   proposals back (their entries lie past the position, hidden by the mask, and are overwritten).
2. Rows with more than CATCH_UP_WIDTH tokens to run (a new row's prompt, a row that did not ask
   for a while) first run all of them but the last, gathered out of their slots into buffers of
   their own, right-padded, in chunks of `prefill_step` positions, and scattered back.
3. One catch-up call over every slot runs each asking row's remaining tokens (right-padded to the
   longest); each row's logits at its last real token give its first guess.
4. k - 1 single-token calls over every slot feed each row's latest guess while it still proposes.

A slot that is not asking (a row that did not ask this step, a row whose k is reached, a free slot)
runs padding at its own position: written past the tokens it holds, it is hidden and overwritten
later, so the row is not disturbed. The calls are not compiled: on the CPU compiling them per
shape saved only 4-7% a proposal (docs/bench/cpu/draft-batching/), and each new shape would be
traced, and its kernels built, in a serving step. Proposals are those of the row alone through mlx-lm, up to floating-point
ties: the slot buffers are exact where the compiled engine's are, which the constructor checks
(plain KV caches, a covered architecture, the probe: worker/engines/decode_path.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from worker.engines.decode_path import compiled_unsupported_reason
from worker.engines.slot_cache import KVLayout, SlotBuffers
from worker.engines.slot_table import SlotTable
from worker.engines.speculation.drafter import DraftRow

# Prompt tokens run through the draft model per call (as the served model's prefill step).
PREFILL_STEP = 2048
# The most tokens a row runs in the catch-up call: every slot runs this call at the longest row's
# width, so longer runs (a row's prompt, a row back after a pause) go through the gathered prefill.
# A row that asks every step has 1 or 2 (its last input, and a bonus token after a full acceptance).
CATCH_UP_WIDTH = 4
# The slot table has no limit of its own: the engine's max_num_seqs bounds the rows that ask.
_NO_SLOT_LIMIT = 1 << 20


class VocabularyMismatch(ValueError):
    """The draft model's tokenizer is not the served model's."""


def check_same_vocabulary(tokenizer: Any, draft_tokenizer: Any) -> None:
    """Refuse a draft model whose token ids mean other text than the served model's: its proposals
    would be ids of other tokens, and would be rejected."""
    ours, theirs = dict(tokenizer.get_vocab()), dict(draft_tokenizer.get_vocab())
    if ours == theirs:
        return
    differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
    raise VocabularyMismatch(
        f"MLXQ_DRAFT_MODEL: its tokenizer differs from the served model's ({len(theirs)} tokens against "
        f"{len(ours)}; e.g. {', '.join(f'{token!r}={index}' for token, index in differing)}): a draft model must "
        "share the served model's tokenizer")


@dataclass
class _DraftRow:
    """A row's slot: `held` are the tokens whose keys and values it holds, at positions 0, 1, ..."""

    held: list[int] = field(default_factory=list)
    confirmed: int = 0  # how many of them are the row's own (not proposed) tokens
    slot: int = -1

    @property
    def position(self) -> int:
        """Where its next token's keys and values go."""
        return len(self.held)


@dataclass
class _Asking:
    """A row asking this step: its state, its tokens and what is still to run through its slot."""

    state: _DraftRow
    tokens: list[int]
    k: int
    rest: list[int]

    @property
    def prefills(self) -> bool:
        """Whether it has more to run than the catch-up call takes: all but its last token go through
        the gathered prefill first."""
        return len(self.rest) > CATCH_UP_WIDTH

    @property
    def catch_up(self) -> int:
        """The tokens it runs in the catch-up call: all it has to run, or, after the prefill, its last one."""
        return 1 if self.prefills else len(self.rest)


class DraftModelDrafter:
    name = "draft"
    judged_as_a_whole = True
    guesses_first_token = True
    graded = False

    def __init__(self, model: Any, vocab_size: int, prefill_step: int = PREFILL_STEP) -> None:
        """`vocab_size`: the served model's; the draft model proposes no id at or past it."""
        reason = compiled_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"MLXQ_DRAFT_MODEL: its rows cannot share batched slot caches: {reason}; use a model "
                             "with plain KV caches of an architecture the compiled engine covers")
        self.model = model
        self._vocab_size = vocab_size
        self._prefill_step = prefill_step
        self._layout = KVLayout.of(model)
        self.kv_bytes_per_token = self._layout.bytes_per_token
        self._table: SlotTable[_DraftRow] = SlotTable(self._layout, _NO_SLOT_LIMIT)
        self._rows: dict[str, _DraftRow] = {}

    def share_kv_budget(self, budget_bytes: int) -> None:
        assert not self._rows, "the budget is shared before the first proposal"
        self._table = SlotTable(self._layout, _NO_SLOT_LIMIT, budget_bytes)

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in rows]
        joining = [row for row in rows if row.k > 0 and row.uid not in self._rows]
        if joining:  # (room for all of them at once: one resize at most)
            self._table.reserve(len(joining), max(len(row.tokens) for row in joining))
            for row in joining:
                self._table.place(self._rows.setdefault(row.uid, _DraftRow()))
        asking = {i: self._asking(row) for i, row in enumerate(rows) if row.k > 0}
        if not asking:
            return proposals
        long = [a for a in asking.values() if a.prefills]
        width = max(a.catch_up for a in asking.values())
        self._fit(list(asking.values()), width)
        if long:
            self._prefill(long)
        guesses = self._catch_up(list(asking.values()), width)
        live = list(asking)
        while True:
            mx.eval(guesses, *self._buffers().arrays())
            for i, token in zip(live, guesses.tolist()):
                proposals[i].append(token)
            live = [i for i in live if len(proposals[i]) < asking[i].k]
            if not live:
                return proposals
            guesses = self._feed([(asking[i].state, proposals[i][-1]) for i in live])

    def _asking(self, row: DraftRow) -> _Asking:
        """The row's slot moved back to the longest prefix it shares with the row's tokens, and the
        tokens past it."""
        state = self._rows[row.uid]
        tokens = list(row.tokens)
        limit = min(len(state.held), len(tokens) - 1)  # at least the last token is run again
        shared = min(state.confirmed, limit)  # a row's own tokens never change: compare only past them
        while shared < limit and state.held[shared] == tokens[shared]:
            shared += 1
        del state.held[shared:]
        state.confirmed = min(state.confirmed, shared)
        return _Asking(state, tokens, row.k, tokens[shared:])

    def _fit(self, asking: list[_Asking], width: int) -> None:
        """Size the buffers for every position this proposal writes in them: each slot's catch-up
        call (`width` from its position once the prefill has run) and each asking row's fed guesses.
        (The gathered prefill's padding may reach further: it is cut off before it is scattered back.)"""
        mine = {id(a.state) for a in asking}
        # An asking row's catch-up runs its last `catch_up` tokens and padding up to `width`; it then
        # feeds k - 1 guesses after its tokens, then padding at the next position.
        ends = [max(len(a.tokens) - a.catch_up + width, len(a.tokens) + a.k) for a in asking]
        ends += [s.position + width for s in self._table.occupied() if id(s) not in mine]
        top = max(s.position for s in self._table.occupied()) + 1
        self._table.fit(waiting=False, ahead=max(ends) - top)

    def _prefill(self, long: list[_Asking]) -> None:
        """The tokens to run of every row of `long` but its last, right-padded, in one batch gathered out
        of their slots (the other slots run nothing), in chunks of `prefill_step` positions."""
        buffers = self._buffers()
        runs = [a.rest[:-1] for a in long]
        starts = [a.state.position for a in long]
        width = max(len(r) for r in runs)
        slots = [a.state.slot for a in long]
        part = buffers.resized(len(long), max(starts) + width, slots)
        tokens = mx.array([r + [0] * (width - len(r)) for r in runs], dtype=mx.int32)
        for start in range(0, width, self._prefill_step):
            if start:
                mx.eval(part.arrays())
            caches = part.layer_caches(mx.array([s + start for s in starts], dtype=mx.int32), self._layout.grouped_mask)
            self.model(tokens[:, start:start + self._prefill_step], cache=caches)
            part.absorb(caches)
        if part.length > buffers.length:  # (the padding past a row's tokens may reach past the buffers)
            part = part.gather(list(range(len(long))), buffers.length)
        buffers.scatter(slots, part)
        for a, run in zip(long, runs):
            a.state.held += run
            a.rest = a.rest[len(run):]

    def _catch_up(self, asking: list[_Asking], width: int) -> mx.array:
        """Each asking row's remaining tokens through its slot, every slot at `width`: the argmax after
        each asking row's last token, in order (lazy)."""
        buffers = self._buffers()
        padded = [[0] * width for _ in range(buffers.slots)]
        for a in asking:
            padded[a.state.slot][: len(a.rest)] = a.rest
        logits = self._call(mx.array(padded, dtype=mx.int32), buffers)
        at = logits[mx.array([a.state.slot for a in asking]), mx.array([len(a.rest) - 1 for a in asking])]
        for a in asking:
            a.state.held, a.state.confirmed = a.tokens, len(a.tokens)
        return mx.argmax(at[:, : self._vocab_size], axis=-1)

    def _feed(self, fed: list[tuple[_DraftRow, int]]) -> mx.array:
        """One token into each row's slot of `fed` ((its row, the token)): the argmax after it, in
        order (lazy)."""
        buffers = self._buffers()
        tokens = [0] * buffers.slots
        for state, token in fed:
            tokens[state.slot] = token
        logits = self._call(mx.array(tokens, dtype=mx.int32)[:, None], buffers)
        for state, token in fed:
            state.held.append(token)
        return mx.argmax(logits[mx.array([state.slot for state, _ in fed]), 0, : self._vocab_size], axis=-1)

    def _call(self, tokens: mx.array, buffers: SlotBuffers) -> mx.array:
        """`tokens` (slots, width) through the model, each slot at its row's position (a free slot at 0);
        the buffers take the written keys and values. Logits (slots, width, vocabulary), lazy."""
        positions = [0] * buffers.slots
        for state in self._table.occupied():
            positions[state.slot] = state.position
        buffers.check_room(positions, tokens.shape[1])
        caches = buffers.layer_caches(mx.array(positions, dtype=mx.int32), self._layout.grouped_mask)
        logits = self.model(tokens, cache=caches)
        buffers.absorb(caches)  # (the old arrays are then the graph's alone: updated in place)
        return logits

    def _buffers(self) -> SlotBuffers:
        assert self._table.buffers is not None
        return self._table.buffers

    @property
    def rows(self) -> list[str]:
        """The rows whose draft slots it keeps."""
        return list(self._rows)

    def grade(self, uid: str) -> int:
        return 0  # ungraded: its rows' own acceptance decides (adaptive.py)

    def accepted(self, uid: str, proposed: int, accepted: int) -> None:
        pass  # the next proposal moves the row back to what its tokens confirm

    def forget(self, uid: str) -> None:
        state = self._rows.pop(uid, None)
        if state is not None:
            self._table.vacate(state)
        if not self._rows:
            self._table.release()

    def reset(self) -> None:
        self._rows.clear()
        self._table.release()
