"""What the scheduler needs from an engine, and the records that cross that seam."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, runtime_checkable

from schemas import GenerationRequest
from worker.replies import ReplyFormat


PromptScores = tuple[list[Optional[float]], Optional[list[list[tuple[int, float]]]]]


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


@dataclass(frozen=True)
class Prompt:
    """A request's input as an engine will run it (`Engine.prepare`)."""

    token_ids: list[int]
    # Memory the prompt needs on top of its KV cache while it is prefilled (a vision encoder's
    # activations); admission counts it.
    extra_bytes: int = 0
    # What the token ids do not carry (an image's pixels), private to the engine that prepared it.
    inputs: Any = None
    # How the reply's text splits into reasoning, answer and tool calls (worker/replies.py); None: as it is.
    reply: Optional[ReplyFormat] = None


StatValue = Union[int, float, str, bool]


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters since it started: where its time went (worker/engines/counters.py)
    and its prompt cache (worker/engines/prefix_cache.py), flat scalars each."""

    counters: Mapping[str, StatValue]
    prefix_cache: Mapping[str, StatValue]

    def flat(self) -> dict[str, StatValue]:
        """As the worker's stats hash names them: `engine_<counter>`, `prefix_cache_<counter>`."""
        return {**{f"prefix_cache_{k}": v for k, v in self.prefix_cache.items()},
                **{f"engine_{k}": v for k, v in self.counters.items()}}


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
    logprobs_mode: str = "raw"  # "raw" | "processed" (see worker/engines/sampling.py)
    choice_index: int = 0
    request_id: str = ""  # the request (job) it is a choice of
    inputs: Any = None  # Prompt.inputs of the request: the engine's own
    adapter: Optional[str] = None  # the request's LoRA adapter, by name (None: the base model)
    # Score the prompt: each token's logprob and this many top entries (GenerationRequest.prompt_logprobs).
    # Its first event carries them (TokenEvent.prompt_logprobs); with max_tokens 0 that is all it gets.
    prompt_logprobs: Optional[int] = None
    # Whether it may speculate where the worker does (GenerationRequest.speculative; docs/speculative.md).
    speculative: bool = True


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
    # On the last token of a constrained sequence: whether its text is a complete match of the
    # constraint (worker/engines/constraints.py); None for unconstrained sequences.
    constraint_complete: Optional[bool] = None
    # The version of the weights that sampled this token (Engine.swap_weights).
    weight_version: Optional[int] = None
    # The prompt's scores, on a sequence's first event when its spec asked (SequenceSpec.prompt_logprobs):
    # (logprobs, one per prompt token, None first; top entries [(token id, logprob)] per token, or None).
    prompt_logprobs: Optional[PromptScores] = None
    # No token: a sequence that ends with nothing generated (max_tokens 0); `token` is meaningless.
    empty: bool = False
    # On the first token of a speculative step (docs/speculative.md): (drafter, tokens it proposed,
    # proposed tokens that were accepted and returned).
    speculation: Optional[tuple[str, int, int]] = None


def adapter_not_served(name: str, refusal: str) -> ValueError:
    """What `register_adapter` raises on an engine that serves no adapters (`adapter_refusal` says why)."""
    return ValueError(f"adapter: {name!r} cannot be served here: {refusal}")


class Engine(Protocol):
    """A continuous-batching engine: sequences are added and removed between steps."""

    # How requests for LoRA adapters share its batch: "rows" (any mix in one step), "grouped" (one
    # adapter at a time), None (it serves none, for the reason in `adapter_refusal`).
    adapter_batching: Optional[str]
    adapter_refusal: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def num_active(self) -> int: ...

    @property
    def context_length(self) -> Optional[int]:
        """The most tokens (prompt and output) one sequence may hold; None: no known limit."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence takes (0: unknown / not memory-bound)."""
        ...

    def prepare(self, request: GenerationRequest) -> Prompt:
        """Tokenize the request's input (raw prompt, chat messages, or ids as given) and whatever
        else it carries; raises ValueError naming the field when this engine cannot run it."""
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

    def stats(self) -> EngineStats: ...

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine samples with now (0: the weights it loaded with)."""
        ...

    def swap_weights(self, files: list[Path], version: int) -> None:
        """Swap a checked version's safetensors in between two steps (worker/weights.py): tokens
        sampled from now on carry `version`; the prefix cache starts empty. Raises WeightsError
        (a ValueError), leaving the old weights, if the model refuses them."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def register_adapter(self, name: str, directory: Path) -> None:
        """A published LoRA adapter is ready in `directory`: requests naming it use it from now on.
        Raises ValueError naming the adapter where the engine serves none (`adapter_batching` None)."""
        ...

    def parameter_spec(self) -> Optional[dict[str, tuple[str, tuple[int, ...]]]]:
        """What a weight version must hold (engines/weight_swap.py); None: no weights (the fake engine)."""
        ...


@runtime_checkable
class WatchesQueue(Protocol):
    """An engine whose choices depend on whether requests wait for a slot where every slot is taken
    (the compiled engine's speculation: a batch nothing waits on waits for its last row). Until
    told, a full engine takes it that requests wait."""

    def queue_seen(self, jobs_waiting: bool) -> None:
        """The worker's latest poll found `jobs_waiting` in its queues (or none)."""
        ...


@runtime_checkable
class ReadsImages(Protocol):
    """An engine whose requests may name images in files or at URLs (the vision engine): those
    (worker/images.py io_image_inputs) are read first, off the loop's thread and each within its
    deadline (worker/input_prep.py), then handed to `prepare`."""

    def read_image(self, field: str, url: str, deadline: float) -> bytes:
        """That input's bytes, by `deadline` (a time.monotonic() time); ImageError naming `field` if not."""
        ...

    def prepare(self, request: GenerationRequest, fetched: Optional[Mapping[str, bytes]] = None) -> Prompt: ...
