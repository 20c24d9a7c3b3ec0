"""A deterministic engine with no model: for scheduler and worker-loop tests and for measuring
the queue's own overhead. Token i of a sequence is a pure function of its prompt and i."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from schemas import GenerationRequest
from worker.engines.base import EngineStats, Prompt, SequenceSpec, TokenEvent, adapter_not_served

VOCAB = 256
EOS = 0


def fake_token(prompt: list[int], position: int, temperature: float = 0.0, seed: int | None = None,
               version: int = 0) -> int:
    """Version 0 is the engine's own weights; each later version of them gives other tokens."""
    base = (sum(prompt) * 31 + len(prompt) * 7 + position * 13 + version * 101) % (VOCAB - 1) + 1
    if temperature and seed is not None:
        base = (base + seed * 17) % (VOCAB - 1) + 1
    return base


def fake_chat_template(request: GenerationRequest) -> str:
    """The fake engine's chat template: `role: text` lines (the gateway's chat tests run on it)."""
    lines = []
    for message in request.messages or []:
        content = message.content or ""
        parts = [content] if isinstance(content, str) else [getattr(p, "text", "") for p in content]
        lines.append(f"{message.role}: {''.join(parts)}")
    return "\n".join(lines) + "\nassistant:"


def fake_prompt_logprob(prompt: list[int], position: int) -> float:
    return -0.25 * (1 + (prompt[position] + position) % 8)


def fake_prompt_scores(prompt: list[int], top_k: int) -> Any:
    """Each token's fake logprob (None first); its top entries: itself, then the next ids, each half as likely."""
    logprobs = [None] + [fake_prompt_logprob(prompt, i) for i in range(1, len(prompt))]
    if not top_k:
        return logprobs, None
    tops = [[]] + [[((prompt[i] + j) % VOCAB, fake_prompt_logprob(prompt, i) - j * math.log(2.0))
                    for j in range(top_k)] for i in range(1, len(prompt))]
    return logprobs, tops


@dataclass
class _Seq:
    spec: SequenceSpec
    produced: int = 0
    prefilled: bool = False


# Fault injection, by a prompt's first token (tests drive real worker processes with these).
EOS_SOON, RAISE_IN_STEP, HANG_IN_STEP, LOSE_DEVICE_IN_STEP = 255, 254, 253, 252


class FakeEngine:
    """Prefill takes one step; each later step emits one token per sequence.
    A prompt whose first token is EOS_SOON samples EOS as its third token; RAISE_IN_STEP makes
    every step that holds it raise (an engine failure no row can be blamed for); HANG_IN_STEP
    makes the step sleep for an hour (a hung engine); LOSE_DEVICE_IN_STEP raises CUDA's sticky
    illegal-address error, after which nothing runs on a real device."""

    adapter_batching = None
    adapter_refusal = "this worker's engine serves no LoRA adapters"

    def register_adapter(self, name: str, directory: Path) -> None:
        raise adapter_not_served(name, self.adapter_refusal)

    def __init__(self, step_delay_s: float = 0.0, kv_bytes_per_token: int = 0) -> None:
        self._kv_bytes_per_token = kv_bytes_per_token
        self._seqs: dict[str, _Seq] = {}
        self.prefill_tokens = 0
        self.steps = 0
        self._version = 0
        self._step_delay_s = step_delay_s
        self._scored: list[TokenEvent] = []  # prompts only scored: they end at the next step
        self._scores: dict[str, Any] = {}  # a scored prompt's scores, for its sequence's first event

    @property
    def vocab_size(self) -> int:
        return VOCAB

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS})

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    @property
    def context_length(self) -> Optional[int]:
        return None

    def reset(self) -> None:
        self._seqs.clear()
        self._scored.clear()
        self._scores.clear()

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        text = request.prompt if request.prompt is not None else fake_chat_template(request)
        return [min(ord(ch), VOCAB - 1) for ch in text]

    def prepare(self, request: GenerationRequest) -> Prompt:
        return Prompt(self.prompt_token_ids(request))

    # Prompt scores: token i's logprob is fake_prompt_logprob(prompt, i); its top entries are itself first.
    serves_prompt_logprobs = True

    def add(self, specs: list[SequenceSpec]) -> None:
        for spec in specs:
            if spec.prompt_logprobs is not None:
                scores = fake_prompt_scores(spec.prompt_token_ids, spec.prompt_logprobs)
                if spec.max_tokens == 0:
                    self._scored.append(TokenEvent(spec.uid, -1, spec.choice_index, finish_reason="length",
                                                   prompt_logprobs=scores, empty=True))
                    continue
                self._scores[spec.uid] = scores
            self._seqs[spec.uid] = _Seq(spec)

    def step(self) -> list[TokenEvent]:
        self.steps += 1
        firsts = {seq.spec.prompt_token_ids[0] for seq in self._seqs.values()}
        if RAISE_IN_STEP in firsts:
            raise RuntimeError("fake engine: injected step failure")
        if LOSE_DEVICE_IN_STEP in firsts:
            raise RuntimeError("fake engine: cudaMemcpy(data, buf.data, buf.size, kind) failed: "
                               "an illegal memory access was encountered")
        if HANG_IN_STEP in firsts:
            time.sleep(3600)
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        events, self._scored = self._scored, []
        for uid, seq in list(self._seqs.items()):
            if not seq.prefilled:
                seq.prefilled = True
                self.prefill_tokens += len(seq.spec.prompt_token_ids)
                continue
            spec = seq.spec
            token = fake_token(spec.prompt_token_ids, seq.produced, spec.sampling.temperature, spec.sampling.seed,
                               self._version)
            if spec.prompt_token_ids[0] == EOS_SOON and seq.produced == 2:
                token = EOS
            seq.produced += 1
            finish = None
            if token in spec.stop_token_ids:
                finish = "stop"
            elif seq.produced >= spec.max_tokens:
                finish = "length"
            logprob = -math.log(2.0) if spec.logprobs else None
            # The sampled token first, then the tokens after it in the vocabulary, less likely each.
            top = [((token + i) % VOCAB, -math.log(2.0) - i) for i in range(spec.top_logprobs)] \
                if spec.top_logprobs else None
            events.append(TokenEvent(uid, token, spec.choice_index, logprob, top, finish, weight_version=self._version,
                                     prompt_logprobs=self._scores.pop(uid, None)))
            if finish:
                del self._seqs[uid]
        return events

    def remove(self, uids: list[str]) -> None:
        for uid in uids:
            self._seqs.pop(uid, None)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(32 + t % 95) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    @property
    def weight_version(self) -> int:
        return self._version

    def swap_weights(self, files: list[Path], version: int) -> None:
        """No weights to swap: the version changes the tokens (see fake_token)."""
        self._version = version

    def reset_prefix_cache(self) -> None:
        pass

    def parameter_spec(self) -> None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats(counters={"decode_steps": self.steps, "prefill_tokens": self.prefill_tokens},
                           prefix_cache=self.prefix_cache_stats())

    def prefix_cache_stats(self) -> dict[str, Any]:
        """The text engine's prefix-cache fields, for a cache this engine does not have."""
        return {"enabled": False, "disabled_reason": "fake engine", "entries": 0, "bytes": 0, "max_bytes": 0,
                "min_match": 0, "lookups": 0, "hits": 0, "prompt_tokens": 0, "reused_tokens": 0,
                "hit_rate": 0.0, "evictions": 0, "skipped_stores": 0}
