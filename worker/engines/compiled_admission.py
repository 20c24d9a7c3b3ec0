"""The compiled engine's admission (worker/engines/compiled.py): the sequences added and waiting for
a slot, and the prefill batches that move them into slots.

`add` groups a call's sequences by adapter (each sequence holds its adapter until it ends; an adapter
that cannot be had fails its sequences at once), scores the prompts that asked for their logprobs
(worker/engines/prompt_scores.py) and starts every distinct prompt from the longest cached prefix
(worker/engines/prefix_cache.py), so a request's n choices share one prefill. `admit` moves waiting
sequences into free slots, in order, a prefill batch at a time (worker/engines/slot_prefill.py), and
samples their first tokens where the prefill takes their last prompt token.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import islice
from typing import Any, Callable, Optional

import mlx.core as mx

from worker.adapters import AdapterError
from worker.engines.base import SequenceSpec, TokenEvent
from worker.engines.compiled_rows import DecodingSequence, LaunchedStep, WaitingPrompt
from worker.engines.counters import EngineCounters
from worker.engines.lora import LoraBank
from worker.engines.prefix_cache import PrefixCache, plan_starts
from worker.engines.prompt_scores import PromptScorer
from worker.engines.slot_prefill import SlotPrefill
from worker.engines.slot_table import SlotTable
from worker.engines.step_sampling import StepSampler

# That prefill's logits (every position of its chunk: the model returns them all) may take at most
# this many bytes; a bigger prefill batch (a wave) leaves its first tokens to a decode step.
FIRST_TOKEN_LOGITS_MAX_BYTES = 256 << 20

MakeSequence = Callable[[SequenceSpec], DecodingSequence]


class Admission:
    def __init__(self, table: SlotTable[DecodingSequence], prefill: SlotPrefill, lora: LoraBank, prefix: PrefixCache,
                 scorer: PromptScorer, counters: EngineCounters, make_sequence: MakeSequence, *,
                 logits_bytes_per_token: int, prefill_batch_size: int, prefill_step_size: int,
                 first_at_prefill: bool) -> None:
        """`make_sequence`: a spec's decoding sequence (its sampler and processors: the engine's);
        `first_at_prefill`: the prefill takes every prompt token and samples the first token
        (compiled.py says where); `logits_bytes_per_token`: one position's logits, to bound that prefill's."""
        self._table = table
        self._prefill = prefill
        self._lora = lora
        self._prefix = prefix
        self._scorer = scorer
        self._counters = counters
        self._make_sequence = make_sequence
        self._logits_bytes_per_token = logits_bytes_per_token
        self._prefill_batch_size = prefill_batch_size
        self._prefill_step_size = prefill_step_size
        self._first_at_prefill = first_at_prefill
        self.waiting: deque[WaitingPrompt] = deque()
        # Events that need no step: sequences whose adapter could not be had when added, prompts only scored.
        self._refused: list[TokenEvent] = []

    def add(self, specs: list[SequenceSpec]) -> list[DecodingSequence]:
        """Queue sequences, in order (compiled.py's `add` says what they share); the sequences made."""
        before = len(self.waiting)
        if self._prefix.enabled:
            self._add(specs)
        else:
            by_request: dict[str, list[SequenceSpec]] = {}
            for spec in specs:
                by_request.setdefault(spec.request_id, []).append(spec)
            for request_specs in by_request.values():
                self._add(request_specs)
        return [entry.seq for entry in islice(self.waiting, before, None)]

    def take_refused(self) -> list[TokenEvent]:
        """The events of sequences that ended when added (the next step returns them)."""
        refused, self._refused = self._refused, []
        return refused

    def drop(self, gone: set[int]) -> None:
        """Forget the waiting entries of these sequences (by `id`)."""
        self.waiting = deque(w for w in self.waiting if id(w.seq) not in gone)

    def prefill_whole(self) -> None:
        """Prompts not prefilled yet that start from a cached prefix are prefilled whole (after a weight
        swap: their first token must not read keys and values the old weights wrote)."""
        for entry in self.waiting:
            entry.cache, entry.cached = None, 0

    def clear(self) -> None:
        self.waiting.clear()
        self._refused = []

    def _add(self, specs: list[SequenceSpec]) -> None:
        by_adapter: dict[Optional[str], list[SequenceSpec]] = {}
        for spec in specs:
            by_adapter.setdefault(spec.adapter, []).append(spec)
        for adapter, adapter_specs in by_adapter.items():
            if adapter is None:
                self._add_group(adapter_specs, self._prefix, 0)
                continue
            try:
                key, slot = self._lora.pin(adapter)
            except AdapterError as exc:
                self._refused += [TokenEvent(uid=s.uid, token=-1, index=s.choice_index, error=str(exc))
                                  for s in adapter_specs]
                continue
            for _ in adapter_specs[1:]:
                self._lora.pin(adapter)  # one hold per sequence
            # The prefix cache holds the base model's keys and values only: an adapter's sequences
            # share their own prefills (a request's n choices), nothing across requests.
            self._add_group(adapter_specs, PrefixCache(0), slot, key)

    def _add_group(self, specs: list[SequenceSpec], prefix: PrefixCache, slot: int,
                   adapter: Optional[str] = None) -> None:
        specs = self._score_prompts(specs, slot, adapter)
        groups: dict[tuple[int, ...], list[SequenceSpec]] = {}
        for spec in specs:
            groups.setdefault(tuple(spec.prompt_token_ids), []).append(spec)
        starts = plan_starts(prefix, {prompt: len(group) for prompt, group in groups.items()},
                             lambda tokens, cache: self._prefill_alone(tokens, cache, slot))
        for prompt, group in groups.items():
            cache, cached, _owned = starts[prompt]  # only read here: ownership does not matter
            for spec in group:
                self._queue(spec, adapter, slot, cache, cached)

    def _score_prompts(self, specs: list[SequenceSpec], slot: int, adapter: Optional[str]) -> list[SequenceSpec]:
        """The sequences that asked for their prompt's logprobs, scored (worker/engines/prompt_scores.py):
        those that only asked that end now, the others wait for a slot holding the scoring's cache
        (all but their last token); the rest are returned for the ordinary path."""
        taken = self._scorer.take(specs, slot)
        self._refused += taken.ended
        if adapter is not None:
            for _ in taken.ended:
                self._lora.unpin(adapter)  # the hold `_add` took for each
        for group in taken.going_on:
            for spec in group.specs:
                self._queue(spec, adapter, slot, group.cache, group.cached)
        return taken.rest

    def _queue(self, spec: SequenceSpec, adapter: Optional[str], slot: int, cache: Optional[list[Any]],
               cached: int) -> None:
        seq = self._make_sequence(spec)
        seq.adapter, seq.adapter_slot = adapter, slot
        self.waiting.append(WaitingPrompt(seq, cache, cached))

    def _prefill_alone(self, tokens: list[int], cache: Optional[list[Any]] = None, adapter_slot: int = 0
                       ) -> list[Any]:
        """Run `tokens` through the model (under the adapter in `adapter_slot`) on top of `cache`
        (mlx-lm caches; fresh ones if None), in place: a prefix several sequences start from."""
        started = time.perf_counter()
        cache, _ = self._prefill.on_own_cache(tokens, cache, adapter_slot)
        mx.eval([c.state for c in cache])
        self._counters.add_own_prefill(len(tokens), time.perf_counter() - started)
        return cache

    def admit(self, sampling: StepSampler, weight_version: int) -> tuple[float, Optional[LaunchedStep], int]:
        """Move waiting sequences into free slots, in order: those with nothing left to prefill,
        and up to a prefill batch of the others (at least one, at most prefill_step_size tokens
        beyond the first). Returns the seconds spent prefilling, the first tokens the prefill
        sampled (lazy; None if it sampled none), and how many admitted sequences take their first
        token from a decode step instead (nothing to prefill but the last token, or on the CPU)."""
        room = self._table.free
        taken: list[WaitingPrompt] = []
        prefills = budget = 0
        while self.waiting and len(taken) < room:
            entry = self.waiting[0]
            rest = len(entry.rest)
            if rest:
                if prefills >= self._prefill_batch_size or (prefills and budget + rest > self._prefill_step_size):
                    break
                prefills += 1
                budget += rest
            taken.append(self.waiting.popleft())
        if not taken:
            return 0.0, None, 0
        started = time.perf_counter()
        prefilling = [e for e in taken if e.rest]
        width = min(max((len(e.rest) for e in prefilling), default=0) + 1, self._prefill_step_size)
        logits_bytes = len(prefilling) * width * self._logits_bytes_per_token
        with_last = self._first_at_prefill and logits_bytes <= FIRST_TOKEN_LOGITS_MAX_BYTES
        span = max(e.cached for e in taken) + max(len(e.to_prefill(with_last)) for e in taken)
        table = self._table
        table.reserve(len(taken), max(span, max(len(e.seq.prompt) for e in taken)))
        assert table.buffers is not None and table.inputs is not None
        for entry in taken:
            table.place(entry.seq)
            entry.seq.position = entry.cached + len(entry.to_prefill(with_last))
        by_cache: dict[int, list[WaitingPrompt]] = {}
        for entry in taken:
            if entry.cache is not None:
                by_cache.setdefault(id(entry.cache), []).append(entry)
        for entries in by_cache.values():
            table.buffers.write_prefix([e.seq.slot for e in entries], entries[0].cache, entries[0].cached)
        last_logits = None
        if len(prefilling) == 1 and not prefilling[0].cached:
            last_logits = self._prefill.alone_into_slot(table.buffers, prefilling[0], with_last)
        elif prefilling:
            last_logits = self._prefill.batch(table.buffers, prefilling, with_last)
        stepping = [e for e in taken if not (with_last and e.rest)]
        if stepping:
            slots = mx.array([e.seq.slot for e in stepping], dtype=mx.int32)
            table.inputs[slots] = mx.array([e.seq.prompt[-1] for e in stepping], dtype=table.inputs.dtype)
        first: Optional[LaunchedStep] = None
        if last_logits is not None:
            first = _sample_first(sampling, [e.seq for e in prefilling], last_logits, weight_version)
            slots = mx.array([e.seq.slot for e in prefilling], dtype=mx.int32)
            table.inputs[slots] = first.tokens.astype(table.inputs.dtype)
        if not prefilling:
            return 0.0, None, len(stepping)
        if first is None:
            mx.eval(table.buffers.arrays())
        # else reading the first tokens waits for the prefill, and the next launch writes the buffers
        seconds = time.perf_counter() - started
        self._counters.add_own_prefill(sum(len(e.to_prefill(with_last)) for e in prefilling), seconds)
        return seconds, first, len(stepping)


def _sample_first(sampling: StepSampler, seqs: list[DecodingSequence], logits: mx.array,
                  weight_version: int) -> LaunchedStep:
    """The first tokens of `seqs`, from their prefill's logits at each last prompt position
    (row i of `logits` is seqs[i]'s), as a step that sampled them."""
    rows = list(range(len(seqs)))
    inputs = mx.array([seq.prompt[-1] for seq in seqs], dtype=mx.uint32)
    sampling.begin(seqs, inputs)
    tokens, gather, wanting = sampling.sample(logits, inputs, seqs, len(seqs), rows=rows)
    errors = [seq.error for seq in seqs]
    for seq in seqs:
        seq.launches += 1  # its next input, the token sampled now, joins its context
    return LaunchedStep(tokens, list(zip(rows, seqs)), errors, gather, wanting, weight_version)
