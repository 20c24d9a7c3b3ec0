"""Speculative decoding under continuous batching (docs/speculative.md).

`drafter.py` (what a drafter is), `ngram.py` (prompt lookup), `draft_model.py` (a draft model),
`speculator.py` (what a speculation policy does for the engine, and what policies share),
`adaptive.py` (each row's k and when it stops: the draft model's policy), `graded.py` (proposals
judged by their grade: prompt lookup's policy), `verify_step.py` (the verification forward pass on
the slot buffers) and `verify.py` (which proposed tokens are kept). The compiled engine
(worker/engines/compiled.py) runs them.
"""

from typing import Any

from worker.engines.speculation.adaptive import AdaptiveSpeculator
from worker.engines.speculation.drafter import Drafter, DraftRow
from worker.engines.speculation.graded import GradedSpeculator
from worker.engines.speculation.speculator import DEFAULT_MAX_K, DEFAULT_MAX_POSITIONS, Speculator


def speculator_for(drafter: Drafter, *args: Any, **kwargs: Any) -> Speculator:
    """The policy for `drafter`, with `Speculator`'s other arguments: graded where it grades its proposals."""
    return (GradedSpeculator if drafter.graded else AdaptiveSpeculator)(drafter, *args, **kwargs)


__all__ = ["DEFAULT_MAX_K", "DEFAULT_MAX_POSITIONS", "AdaptiveSpeculator", "DraftRow", "Drafter", "GradedSpeculator",
           "Speculator", "speculator_for"]
