"""Speculative decoding under continuous batching (docs/speculative.md).

`drafter.py` (what a drafter is), `ngram.py` (prompt lookup), `draft_model.py` (a draft model),
`adaptive.py` (each row's k, and when it stops), `speculator.py` (which rows propose in a step),
`verify_step.py` (the verification forward pass on the slot buffers) and `verify.py` (which
proposed tokens are kept). The compiled engine (worker/engines/compiled.py) runs them.
"""

from worker.engines.speculation.drafter import Drafter, DraftRow
from worker.engines.speculation.speculator import DEFAULT_MAX_K, DEFAULT_MAX_POSITIONS, Speculator

__all__ = ["DEFAULT_MAX_K", "DEFAULT_MAX_POSITIONS", "DraftRow", "Drafter", "Speculator"]
