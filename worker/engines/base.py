"""What the scheduler needs from an engine, and the records that cross that seam."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from schemas import GenerationRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    seed: Optional[int] = None

    @classmethod
    def from_request(cls, request: GenerationRequest) -> "SamplingParams":
        return cls(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=tuple(sorted(request.logit_bias.items())) if request.logit_bias else None,
            seed=request.seed,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SequenceSpec:
    """One sequence to decode: a request's choice `index`, keyed by `uid`."""

    uid: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids (unless ignore_eos) plus stop_token_ids
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"  # "raw" | "processed" (see worker/sampling.py)
    choice_index: int = 0
    request_id: str = ""  # the request (job) it is a choice of


@dataclass
class TokenEvent:
    """One sampled token of one sequence. `finish_reason` is set on its last token."""

    uid: str
    token: int
    index: int = 0  # the choice this sequence is, within its request
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    finish_reason: Optional[str] = None  # "stop" | "length"
    error: Optional[str] = None  # this sequence failed (and was removed); `token` is meaningless


class Engine(Protocol):
    """A continuous-batching engine: sequences are added and removed between steps."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def num_active(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence takes (0: unknown / not memory-bound)."""
        ...

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """Tokenize the request's input (raw prompt, chat messages, or ids as given)."""
        ...

    def add(self, specs: list[SequenceSpec]) -> None: ...

    def step(self) -> list[TokenEvent]:
        """Advance every active sequence by at most one token (prefill may take a step)."""
        ...

    def remove(self, uids: list[str]) -> None: ...

    def reset(self) -> None:
        """Drop every sequence and start from an empty batch (after a failed step)."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def prefix_cache_stats(self) -> dict[str, Any]:
        """Optional (callers use `getattr(engine, "prefix_cache_stats", None)`): the prompt cache's
        counters, flat scalars (worker/prefix_cache.py `PrefixCache.stats`)."""
        ...

    def time_stats(self) -> dict[str, Any]:
        """Optional, like `prefix_cache_stats`: prefill and decode seconds, calls and steps since
        the engine started, flat scalars (worker/engines/counters.py `EngineCounters`)."""
        ...
