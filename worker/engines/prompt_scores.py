"""The log-probabilities of a prompt's own tokens (GenerationRequest.prompt_logprobs, docs/tools.md),
for both text engines.

A prompt that asks is prefilled here: the model runs over all of it but its last token on a fresh
mlx-lm cache, a chunk of positions at a time, and each chunk's logits (float32, log-softmaxed) give
the log-probability of every token that follows, and the top entries. The cache left holds what a
prefix-cache hit of all but the last token would, so a sequence that goes on to generate joins its
engine as such a hit (its last token enters the engine's first-token path) and nothing is prefilled
twice. The prefix cache is not read for these prompts (a cached prefix has no logits); they leave
their caches to it when they end, as every sequence does.

Prompts that only want their scores (max_tokens 0) are scored together: right-padded to one length
and run as one batch on one cache (with causal attention, the padding after a row changes none of
its logits). A chunk's logits take at most LOGITS_CHUNK_BYTES.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.engines.base import PromptScores, SequenceSpec, TokenEvent
from worker.engines.counters import EngineCounters
from worker.engines.sampling import LogprobGather

LOGITS_CHUNK_BYTES = 128 << 20
# Prompts scored in one batch: at most this many padded tokens.
BATCH_TOKENS = 8192

# A context in which the model runs these rows with their adapters (worker/engines/lora.py `LoraBank.rows`).
RowsContext = Callable[[list[int]], AbstractContextManager[Any]]


@dataclass(frozen=True)
class ScoreRequest:
    tokens: list[int]
    top_k: int
    adapter_slot: int = 0


@dataclass
class ScoredGroup:
    """Sequences with one prompt, scored, that go on to generate from the scoring's cache."""

    prompt: list[int]
    specs: list[SequenceSpec]
    scores: PromptScores
    cache: Optional[list[Any]]  # all the prompt's tokens but the last (None: a one-token prompt)

    @property
    def cached(self) -> int:
        return len(self.prompt) - 1 if self.cache is not None else 0


@dataclass
class ScoredSpecs:
    """`PromptScorer.take`'s answer: what an engine's `add` does next with each sequence."""

    rest: list[SequenceSpec]  # those that asked for no scores: the ordinary path
    ended: list[TokenEvent]  # those that asked for scores only: their one (empty) event
    going_on: list[ScoredGroup]


class PromptScorer:
    def __init__(self, model: Any, vocab_size: int, step_size: int, rows: RowsContext,
                 counters: EngineCounters) -> None:
        self._model = model
        self._vocab_size = vocab_size
        self._step_size = step_size
        self._rows = rows
        self._counters = counters
        # The scores of prompts whose sequences go on, until their first event carries them (`attach`).
        self._pending: dict[str, PromptScores] = {}

    def take(self, specs: list[SequenceSpec], adapter_slot: int) -> ScoredSpecs:
        """Score the prompts of the sequences that ask (run under the adapter in `adapter_slot`)."""
        scoring = [spec for spec in specs if spec.prompt_logprobs is not None]
        if not scoring:
            return ScoredSpecs(specs, [], [])
        only = [spec for spec in scoring if spec.max_tokens == 0]
        scored = self.score_only([ScoreRequest(s.prompt_token_ids, s.prompt_logprobs or 0, adapter_slot) for s in only])
        ended = [TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, finish_reason="length",
                            prompt_logprobs=scores, empty=True) for spec, scores in zip(only, scored)]
        groups: dict[tuple[int, ...], list[SequenceSpec]] = {}
        for spec in scoring:
            if spec.max_tokens:
                groups.setdefault(tuple(spec.prompt_token_ids), []).append(spec)
        going_on = []
        for prompt, group in groups.items():
            top = max(spec.prompt_logprobs or 0 for spec in group)
            scores, cache = self.score_alone(ScoreRequest(list(prompt), top, adapter_slot))
            going_on.append(ScoredGroup(list(prompt), group, scores, cache))
            self._pending.update((spec.uid, scores) for spec in group)
        return ScoredSpecs([spec for spec in specs if spec.prompt_logprobs is None], ended, going_on)

    def attach(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """`events`, a scored prompt's scores on its sequence's first one."""
        if self._pending:
            for event in events:
                scores = self._pending.pop(event.uid, None)
                if scores is not None:
                    event.prompt_logprobs = scores
        return events

    def forget(self, uids: list[str]) -> None:
        """Sequences removed before their first event (cancelled)."""
        for uid in uids:
            self._pending.pop(uid, None)

    def clear(self) -> None:
        self._pending.clear()

    def score_alone(self, request: ScoreRequest) -> tuple[PromptScores, Optional[list[Any]]]:
        """One prompt's scores, and the cache of all its tokens but the last (None for a
        one-token prompt: there is nothing to run)."""
        if len(request.tokens) < 2:
            return _unscored(request), None
        cache = make_prompt_cache(self._model)
        return self._run([request], cache)[0], cache

    def score_only(self, requests: list[ScoreRequest]) -> list[PromptScores]:
        """Prompts wanting only their scores, batched as BATCH_TOKENS allows."""
        scores: list[Optional[PromptScores]] = [None] * len(requests)
        batch: list[int] = []
        width = 0
        for i, request in enumerate(requests):
            if len(request.tokens) < 2:
                scores[i] = _unscored(request)
                continue
            longer = max(width, len(request.tokens) - 1)
            if batch and longer * (len(batch) + 1) > BATCH_TOKENS:
                self._score_batch(requests, batch, scores)
                batch, longer = [], len(request.tokens) - 1
            batch.append(i)
            width = longer
        if batch:
            self._score_batch(requests, batch, scores)
        return [s for s in scores if s is not None]

    def _score_batch(self, requests: list[ScoreRequest], batch: list[int], scores: list[Optional[PromptScores]]
                     ) -> None:
        run = self._run([requests[i] for i in batch], make_prompt_cache(self._model))
        for i, made in zip(batch, run):
            scores[i] = made

    def _run(self, requests: list[ScoreRequest], cache: list[Any]) -> list[PromptScores]:
        """Run the requests' prompts but their last tokens, right-padded, through the model on
        `cache`, chunk by chunk, gathering each row's scores."""
        started = time.perf_counter()
        inputs = [r.tokens[:-1] for r in requests]
        width = max(len(i) for i in inputs)
        padded = mx.array([i + [0] * (width - len(i)) for i in inputs], dtype=mx.int32)
        chunk = max(1, min(self._step_size, LOGITS_CHUNK_BYTES // (4 * self._vocab_size * len(requests))))
        top = max(r.top_k for r in requests)
        logprobs: list[list[Optional[float]]] = [[None] for _ in requests]
        tops: list[list[list[tuple[int, float]]]] = [[[]] for _ in requests]
        for start in range(0, width, chunk):
            with self._rows([r.adapter_slot for r in requests]):
                logits = self._model(padded[:, start:start + chunk], cache=cache)
            span = logits.shape[1]
            rows = logits.astype(mx.float32).reshape(-1, logits.shape[-1])
            rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            targets = [r.tokens[start + 1: start + 1 + span] for r in requests]
            following = mx.array([t + [0] * (span - len(t)) for t in targets], dtype=mx.int32).reshape(-1)
            gather = LogprobGather(rows, following, [top] * rows.shape[0])
            mx.eval(gather.arrays, [c.state for c in cache])
            chosen = gather.arrays[0].tolist()
            ids, values = (gather.arrays[1].tolist(), gather.arrays[2].tolist()) if top else ([], [])
            for b, request in enumerate(requests):
                for p in range(len(targets[b])):
                    at = b * span + p
                    logprobs[b].append(float(chosen[at]))
                    if request.top_k:
                        tops[b].append(list(zip(ids[at][: request.top_k], values[at][: request.top_k])))
        self._counters.add_own_prefill(sum(len(i) for i in inputs), time.perf_counter() - started)
        return [(logprobs[b], tops[b] if r.top_k else None) for b, r in enumerate(requests)]


def _unscored(request: ScoreRequest) -> PromptScores:
    return [None] * len(request.tokens), ([[]] * len(request.tokens) if request.top_k else None)

