"""Whether the text engine holds the next prefill batch back until the last one's first tokens are out.

mlx-lm returns a prefill batch's first tokens from the call after the one that finished its prompts,
and if the next batch was handed over by then, that call prefills it before returning: the first
tokens wait for a whole prefill. Holding the next batch back costs a call per prefill batch instead:
a burst of 256 prompts in batches of 8 enters the batch in 96 calls rather than 64, and under churn
every joiner waits a call longer.

Holding the next batch gives the batch whose first tokens are due those tokens a prefill sooner,
and costs every batch waiting behind it a decode step. So it holds only while one prefill call
outlasts the decode steps of all the waiting batches: where prefills are slow against steps, that
saves seconds of first-token time; where they are quick, holding costs more decode calls than it
saves (the measurements: docs/design-notes.md, Prefill pacing).
"""

from __future__ import annotations

from typing import Any, Optional


class PrefillPacing:
    """The last prefill call's and the last decode step's durations, read from mlx-lm's own
    `BatchGenerator.stats()` window around each `next()`."""

    def __init__(self) -> None:
        self.prefill_s: Optional[float] = None
        self.step_s: Optional[float] = None  # from a call that prefilled nothing

    def note(self, window: Any) -> None:
        """Record one `BatchStats` window."""
        if window.prompt_tokens:
            self.prefill_s = window.prompt_time
        elif window.generation_steps:
            self.step_s = window.decode_time / window.generation_steps

    def hold_for_first_tokens(self, waiting_batches: float) -> bool:
        """Hold while a prefill call outlasts a decode step for each of the `waiting_batches`
        prefill batches (at least one) that holding would delay, or either time is not known yet."""
        if self.prefill_s is None or self.step_s is None:
            return True
        return self.prefill_s > self.step_s * max(1.0, waiting_batches)
