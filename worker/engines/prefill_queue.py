"""The text engine's sequences not yet in mlx-lm's batch, and when each goes in.

A sequence joining a batch already decoding is prefilled at admission while an allowance lasts
(worker/engines/text.py `_start_now`); the other joiners are held here until a prefill batch of them
waits. Every prompt that needs a prefill then waits for room in mlx-lm's prefill, a prefill batch at
a time, paced by worker/engines/prefill_pacing.py. The engine hands what comes out of here to mlx-lm.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from worker.engines.prefill_pacing import PrefillPacing
from worker.engines.text_rows import Row


# Joiners prefilled one by one at admission: each stalls the running batch for its own prefill (on
# a GPU, a batch-1 prefill costs about a decode step of the whole batch). An occasional joiner gets
# its first token in the step it joins; under steady churn (a full batch where sequences end every
# step) most go to mlx-lm's batched prefill. At most EAGER_JOINERS_MAX at once; one more is allowed
# per EAGER_REFILL_STEPS decode steps: one eager joiner every step costs a large share of the
# throughput under churn (docs/design-notes.md, Joiners prefilled at admission).
EAGER_JOINERS_MAX = 4
EAGER_REFILL_STEPS = 16

# The other joiners of a decoding batch wait here until a prefill batch of them (mlx-lm's
# prefill_batch_size) is waiting, or the oldest has waited JOINER_HOLD_STEPS decode steps. Handed
# over as they come, they make one small prefill per step under churn, and every prefill call has
# a large fixed cost (mlx-lm evaluates and clears MLX's buffer cache after each one; docs/design-notes.md).
JOINER_HOLD_STEPS = 4


@dataclass
class Held:
    """A sequence not yet handed to mlx-lm: a joiner waiting for the others of its prefill batch,
    or a prompt waiting for room in mlx-lm's prefill."""

    row: Row
    prompt: list[int]  # the tokens still to prefill
    cache: Optional[list[Any]]  # what it starts from (a cached prefix), or None
    cached_tokens: list[int]  # the tokens that cache holds
    since_step: int  # the engine's decode step count when it arrived


class PrefillQueue:
    """Joiners held for a prefill batch of them, prompts waiting for room in mlx-lm's prefill, the
    prompts mlx-lm is prefilling (by engine uid), and the allowance of joiners prefilled at admission."""

    def __init__(self, prefill_batch_size: int, prefill_step_size: int) -> None:
        self._batch_size = prefill_batch_size
        self._step_size = prefill_step_size
        self._held: list[Held] = []  # joiners waiting to be handed to mlx-lm as one prefill batch
        self._to_prefill: deque[Held] = deque()  # prompts waiting for room in mlx-lm's prefill
        self._prefilling: set[int] = set()  # engine uids whose prompts mlx-lm has not finished
        self._awaiting_first: set[int] = set()  # engine uids prefilled by mlx-lm, first token not out yet
        self._decode_steps = 0
        self._eager_allowance = float(EAGER_JOINERS_MAX)  # joiners that may still be prefilled at admission
        self._eager_tokens = 0  # prompt tokens that may still be prefilled at admission in this add
        self.pacing = PrefillPacing()

    def __len__(self) -> int:
        """The sequences waiting here (not those mlx-lm is prefilling)."""
        return len(self._held) + len(self._to_prefill)

    def clear(self) -> None:
        self._held.clear()
        self._to_prefill.clear()
        self._prefilling.clear()
        self._awaiting_first.clear()

    # --- joiners prefilled at admission ---------------------------------------------------------
    def begin_add(self) -> None:
        """A new `add`: it may prefill up to a prefill step's tokens at admission."""
        self._eager_tokens = self._step_size

    def take_eager(self, rest: int) -> bool:
        """Whether a lone joiner with `rest` prompt tokens to prefill is prefilled at admission; if
        so it draws on the allowance."""
        if self._eager_allowance < 1 or rest > self._eager_tokens:
            return False
        self._eager_tokens -= rest
        self._eager_allowance -= 1
        return True

    # --- what waits ----------------------------------------------------------------------------
    def hold(self, rows: list[Row], prompts: list[list[int]], caches: Optional[list[list[Any]]] = None,
             all_tokens: Optional[list[list[int]]] = None) -> None:
        """Joiners of a decoding batch: held until `release` gives them back together."""
        self._held.extend(self._entries(rows, prompts, caches, all_tokens, range(len(rows))))

    def release(self, live: bool) -> list[Held]:
        """The held joiners, once a prefill batch of them waits, the oldest has waited long enough,
        or nothing else is `live` in mlx-lm's batch; otherwise none."""
        if not self._held:
            return []
        full = len(self._held) >= self._batch_size
        waited = self._decode_steps - self._held[0].since_step >= JOINER_HOLD_STEPS
        if not (full or waited or not live):
            return []
        held, self._held = self._held, []
        return held

    def queue(self, rows: list[Row], prompts: list[list[int]], caches: Optional[list[list[Any]]] = None,
              all_tokens: Optional[list[list[int]]] = None) -> list[int]:
        """Queue the prompts that need a prefill, in order; the indexes of the others (a one-token
        prompt: a full cache), which mlx-lm starts at once, without a prefill."""
        self._to_prefill.extend(self._entries(rows, prompts, caches, all_tokens,
                                              (i for i, prompt in enumerate(prompts) if len(prompt) > 1)))
        return [i for i, prompt in enumerate(prompts) if len(prompt) <= 1]

    def _entries(self, rows: list[Row], prompts: list[list[int]], caches: Optional[list[list[Any]]],
                 all_tokens: Optional[list[list[int]]], indexes: Iterable[int]) -> list[Held]:
        return [Held(rows[i], prompts[i], caches[i] if caches else None, all_tokens[i] if all_tokens else [],
                     self._decode_steps) for i in indexes]

    def next_prefill_batch(self) -> list[Held]:
        """The prompts to hand to mlx-lm's prefill now: at most a prefill batch in it, as its own cap
        would keep, and none while the last batch's first tokens are still to come out where a
        prefill outlasts a decode step (see prefill_pacing.py): the call that returns them would run
        that prefill first (on a CPU, 16 prompts in batches of 8 all got their first tokens after
        both prefills, ~14 s, where the first eight can have theirs after ~7 s). Tell `prefilling`
        their engine uids."""
        room = self._batch_size - len(self._prefilling)
        if room <= 0 or not self._to_prefill:
            return []
        waiting_batches = len(self._to_prefill) / self._batch_size
        if self._awaiting_first and self.pacing.hold_for_first_tokens(waiting_batches):
            return []
        return [self._to_prefill.popleft() for _ in range(min(room, len(self._to_prefill)))]

    def prefilling(self, engine_uids: list[int]) -> None:
        self._prefilling.update(engine_uids)

    def prefill_whole(self) -> None:
        """The weights changed: prompts not prefilled yet that start from a cached prefix are
        prefilled whole, on the new weights: their first token must not read keys and values the
        old weights wrote."""
        for held in [*self._held, *self._to_prefill]:
            if held.cache is not None:
                held.prompt, held.cache, held.cached_tokens = held.cached_tokens + held.prompt, None, []

    def remove(self, uids: set[str]) -> None:
        """Sequences (by their own uid) that leave before they reach mlx-lm."""
        if self._held or self._to_prefill:
            self._held = [h for h in self._held if h.row.spec.uid not in uids]
            self._to_prefill = deque(h for h in self._to_prefill if h.row.spec.uid not in uids)

    # --- mlx-lm's side -------------------------------------------------------------------------
    def stepped(self, progress: Iterable[Any], window: Any) -> None:
        """One call of mlx-lm's `next()`: the prompts it finished prefilling (its progress), its
        stats window for the pacing, one more decode step toward the eager allowance."""
        for prompt in progress:
            if prompt.end_of_prompt and prompt.uid in self._prefilling:
                self._prefilling.discard(prompt.uid)
                self._awaiting_first.add(prompt.uid)
        self.pacing.note(window)
        self._decode_steps += 1
        self._eager_allowance = min(EAGER_JOINERS_MAX, self._eager_allowance + 1 / EAGER_REFILL_STEPS)

    def first_token_out(self, engine_uid: int) -> None:
        self._awaiting_first.discard(engine_uid)

    def forget(self, engine_uid: int) -> None:
        """A sequence left mlx-lm's batch."""
        self._prefilling.discard(engine_uid)
        self._awaiting_first.discard(engine_uid)
