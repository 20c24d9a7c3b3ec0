"""Where an engine's time goes: prefill against decode, summed since it started.

Read from mlx-lm's public `BatchGenerator.stats()` window around each `next()` call, plus the
prefills the text engine runs itself (joiners, shared prompts). The worker publishes them in its
stats hash and `mlxq bench` reports them next to the engine-bound arm's, so a throughput gap can
be put down to more prefill calls, slower decode steps or time spent outside the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EngineCounters:
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    prefill_calls: int = 0  # model calls that prefilled prompts (one batched mlx-lm prefill counts once)
    own_prefills: int = 0  # of those, run by the engine itself rather than by mlx-lm's batch
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0

    def add_generator_window(self, window: Any) -> None:
        """Add one `BatchGenerator.stats()` window (a `BatchStats`)."""
        if window.prompt_tokens:
            self.prefill_calls += 1
            self.prefill_tokens += window.prompt_tokens
            self.prefill_s += window.prompt_time
        self.decode_s += window.decode_time
        self.decode_steps += window.generation_steps
        self.decode_tokens += window.generation_tokens

    def add_own_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_calls += 1
        self.own_prefills += 1
        self.prefill_tokens += tokens
        self.prefill_s += seconds

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
