"""The compiled engine's records (worker/engines/compiled.py): a decoding sequence, a prompt waiting
for a slot, and a decode step handed to the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from worker.engines.base import SequenceSpec
from worker.engines.sampling import LogprobGather
from worker.engines.step_sampling import SequenceSampling


@dataclass
class DecodingSequence(SequenceSampling):
    """One sequence's own state: what it samples with (guarded: its sampler's or processors'
    failure ends it alone), its slot and what it has produced."""

    spec: SequenceSpec = field(kw_only=True)
    prompt: list[int] = field(kw_only=True)
    slot: int = -1
    position: int = 0  # where its next input token's keys and values go: the tokens its slot holds
    launches: int = 0  # decode steps it was in
    generated: list[int] = field(default_factory=list)
    context: Optional[mx.array] = None  # prompt and tokens fed so far, for its processors
    done: bool = False
    version: int = 0  # of the weights when it was made: a cache it leaves is that version's only if unchanged
    adapter: Optional[str] = None  # the resident key of its LoRA adapter (held until it ends)
    adapter_slot: int = 0  # that adapter's slot in the LoRA stacks (0: the base model)

    @property
    def error(self) -> Optional[str]:
        """Its own failure while a step was built (a processor, its sampler or its constraint)."""
        return self.guard.error or (self.constraint.error if self.constraint is not None else None)


@dataclass
class WaitingPrompt:
    seq: DecodingSequence
    cache: Optional[list[Any]]  # mlx-lm caches of a prefix it starts from (read, never changed)
    cached: int  # the prompt tokens that cache holds

    @property
    def rest(self) -> list[int]:
        """The prompt tokens to prefill: all but those cached and the last."""
        return self.seq.prompt[self.cached:-1]

    def to_prefill(self, with_last: bool) -> list[int]:
        """The rest, and with `with_last` the last prompt token too where there is a rest (its first
        token is sampled then); a prompt cached but its last token takes it in a decode step."""
        return self.seq.prompt[self.cached:] if with_last and self.rest else self.rest


@dataclass
class LaunchedStep:
    """A decode step handed to the device, read back by the next `step()`."""

    tokens: mx.array  # (slots,)
    rows: list[tuple[int, DecodingSequence]]  # (slot at launch, sequence) of every occupied slot
    errors: list[Optional[str]]  # each row's own failure (processor, sampler) while building it
    logprobs: Optional[LogprobGather]
    wanting: list[int]  # positions in `rows` of the rows whose logprobs `logprobs` holds
    weight_version: int  # of the weights it ran with
