"""Text engine: mlx-lm's BatchGenerator (continuous batching) behind the Engine protocol.

Uses only mlx-lm's public API: `BatchGenerator.insert/next/remove` (insert with `caches` and
`all_tokens` to start a sequence from a KV cache), `StopSequences`, `models.cache`, and (through
worker/engines/sampling.py) `sample_utils`.

Prompts reuse KV caches across requests through worker/engines/prefix_cache.py: a sequence whose prompt
starts with tokens the cache holds enters the batch with a copy of their cache and prefills only
the rest; finished sequences leave their cache (prompt and output) behind for later ones.

A sequence that joins a batch already decoding, and the n choices of one request, are prefilled
here at admission and their first tokens sampled from that prefill (see `_start_now`); the rest of
a burst goes through mlx-lm's batched prefill.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from schemas import GenerationRequest
from worker.adapters import AdapterCatalog, AdapterError
from worker.engines.base import EngineStats, Prompt, SequenceSpec, TokenEvent
from worker.engines.weight_swap import ParameterSpec, parameter_spec, swap_into
from worker.engines.constraints import CompiledConstraint, ConstraintCompiler, MaskBatch, RowConstraint, fenced
from worker.engines.counters import EngineCounters
from worker.engines.lora import LoraBank
from worker.engines.prefill_pacing import PrefillPacing
from worker.engines.prefix_cache import PrefixCache, plan_starts, unsupported_reason
from worker.engines.sampling import (RawLogits, RowGuard, SamplerPool, attach_logprobs, greedy, logits_processors,
                                     needs_raw_capture, repair_random_state, requested_distribution)
from worker.engines.text_model import (RequestRejected, measure_kv_bytes_per_token, model_context_length,  # noqa: F401
                                       model_vocab_size, prepare_prompt, prompt_token_ids)


# Joiners prefilled one by one at admission: each stalls the running batch for its own prefill (on
# a GPU, a batch-1 prefill costs about a decode step of the whole batch). An occasional joiner gets
# its first token in the step it joins; under steady churn (a full batch where sequences end every
# step) most go to mlx-lm's batched prefill. At most EAGER_JOINERS_MAX at once; one more is allowed
# per EAGER_REFILL_STEPS decode steps: one eager joiner every step costs a large share of the
# throughput under churn (docs/design-notes.md, Joiners prefilled at admission).
EAGER_JOINERS_MAX = 4
EAGER_REFILL_STEPS = 16

# The other joiners of a decoding batch wait here until a prefill batch of them (mlx-lm's
# prefill_batch_size) is waiting, or the oldest has waited JOINER_HOLD_STEPS decode steps. Handed
# over as they come, they make one small prefill per step under churn, and every prefill call has
# a large fixed cost (mlx-lm evaluates and clears MLX's buffer cache after each one; docs/design-notes.md).
JOINER_HOLD_STEPS = 4


class TextEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_num_seqs: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        prefix_cache_bytes: int = 0,
        prefix_min_match: int = 16,
        adapters: Optional[AdapterCatalog] = None,
        adapter_memory_bytes: int = 0,
    ) -> None:
        self.model = model
        # LoRA adapters, one at a time (mlx-lm's batch runs every row alike): the scheduler admits
        # only sequences of the adapter (or the base model) the engine holds (adapter_batching).
        self._lora = LoraBank(model, adapters or AdapterCatalog(), adapter_memory_bytes)
        self._group_slot = 0  # the slot of the adapter the live sequences run with (0: the base model)
        self._pinned: dict[str, str] = {}  # sequence uid -> the resident key of its adapter
        self.tokenizer = tokenizer
        self._vocab_size = model_vocab_size(model, tokenizer)
        self._eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._prefill_batch_size = min(prefill_batch_size, max_num_seqs)
        self._generator_options = dict(
            sampler=greedy,
            completion_batch_size=max_num_seqs,
            # mlx-lm's own cap would also meter sequences that start from a full cache (the n choices
            # of a request, joiners prefilled here), which need no prefill, so that they would enter
            # one a step. This engine meters the prompts that do need a prefill itself (_feed_prefill).
            prefill_batch_size=max_num_seqs,
            prefill_step_size=prefill_step_size,
        )
        self._generator = BatchGenerator(model, **self._generator_options)
        self._prefill_step_size = prefill_step_size
        self._live: dict[int, _Row] = {}
        self._early: list[TokenEvent] = []  # first tokens sampled at admission, returned by the next step
        self._eager_allowance = float(EAGER_JOINERS_MAX)  # joiners that may still be prefilled at admission
        self._eager_tokens = 0  # prompt tokens that may still be prefilled at admission in this add
        self._held: list[_Held] = []  # joiners waiting to be handed to mlx-lm as one prefill batch
        self._to_prefill: deque[_Held] = deque()  # prompts waiting for room in mlx-lm's prefill
        self._prefilling: set[int] = set()  # engine uids whose prompts mlx-lm has not finished
        self._awaiting_first: set[int] = set()  # engine uids prefilled by mlx-lm, first token not out yet
        self._decode_steps = 0
        self._engine_uid: dict[str, int] = {}
        self._samplers = SamplerPool(fence=lambda sampler: fenced(sampler, self._fill_masks))
        self._constraints = ConstraintCompiler(tokenizer, self._vocab_size, self._eos)
        self._masks: Optional[MaskBatch] = None  # made with the first constrained row
        self._max_num_seqs = max_num_seqs
        self._counters = EngineCounters()
        self._pacing = PrefillPacing()
        self._version = 0  # of the weights now (swap_weights)
        self._launched_with = 0  # the version mlx-lm's last call launched its forward pass with
        self._kv_bytes_per_token = measure_kv_bytes_per_token(model)
        self._prefix = PrefixCache(prefix_cache_bytes, min_match=prefix_min_match,
                                   disabled_reason=unsupported_reason(make_prompt_cache(model)))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def num_active(self) -> int:
        return len(self._live) + len(self._held) + len(self._to_prefill)

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    @property
    def context_length(self) -> Optional[int]:
        return model_context_length(self.model)

    def reset(self) -> None:
        self._generator.close()
        self._generator = BatchGenerator(self.model, **self._generator_options)
        self._live.clear()
        self._engine_uid.clear()
        self._early.clear()
        self._held.clear()
        self._to_prefill.clear()
        self._prefilling.clear()
        self._awaiting_first.clear()
        self._masks = None
        self._prefix.clear()  # after a failed step nothing it made is trusted
        self._lora.unpin_all()
        self._pinned.clear()
        self._group_slot = 0
        self._samplers = SamplerPool()
        repair_random_state()

    def prefix_cache_stats(self) -> dict[str, Any]:
        return self._prefix.stats()

    def time_stats(self) -> dict[str, Any]:
        return self._counters.as_dict()

    def stats(self) -> EngineStats:
        return EngineStats(counters={**self.time_stats(), **self._lora.stats()}, prefix_cache=self.prefix_cache_stats())

    # One adapter at a time: the scheduler groups requests by adapter.
    adapter_batching = "grouped"
    adapter_refusal = ""

    @property
    def adapters(self) -> LoraBank:
        return self._lora

    def register_adapter(self, name: str, directory: Path) -> None:
        self._lora.publish(name, directory)

    @property
    def weight_version(self) -> int:
        return self._version

    def swap_weights(self, files: list[Path], version: int) -> None:
        swap_into(self.model, files)  # all or nothing
        self._version = version
        self._prefix.clear()  # its caches hold the old weights' keys and values
        # Prompts not prefilled yet that start from a cached prefix are prefilled whole, on the new
        # weights: their first token must not read keys and values the old weights wrote.
        for held in [*self._held, *self._to_prefill]:
            if held.cache is not None:
                held.prompt, held.cache, held.cached_tokens = held.cached_tokens + held.prompt, None, []

    def reset_prefix_cache(self) -> None:
        self._prefix.clear()

    def parameter_spec(self) -> ParameterSpec:
        return parameter_spec(self.model)

    def prepare(self, request: GenerationRequest) -> Prompt:
        """The prompt's token ids and, for a constrained request, its compiled constraint (cached
        per worker: docs/structured-output.md has the compile times)."""
        prompt = prepare_prompt(self.tokenizer, request, self._constraints)
        if request.adapter is not None:
            self._lora.check(request.adapter)  # read now, so a bad adapter fails its job at once
        return prompt

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        return prompt_token_ids(self.tokenizer, request)

    def add(self, specs: list[SequenceSpec]) -> None:
        """Queue sequences, in order. Sequences with the same prompt (a request's n choices) share
        one prefill: the prompt but its last token is run once and each starts from a copy of its KV
        cache. With the prefix cache on, every prompt first takes the longest cached prefix, and
        prompts of one `add` (the scheduler adds a round at once) share their common prefixes'
        prefills; with it off, nothing is shared across requests."""
        # A batch is decoding (not just prefilling a burst that came over two steps): these join it.
        joining = any(row.emitted for row in self._live.values())
        self._eager_tokens = self._prefill_step_size
        specs = self._pin_adapters(specs)
        if not specs:
            return
        if specs[0].adapter is not None:  # the prefix cache holds the base model's keys and values only
            for request_specs in _by_request(specs).values():
                self._add(request_specs, joining, PrefixCache(0))
        elif self._prefix.enabled:
            self._add(specs, joining)
        else:
            for request_specs in _by_request(specs).values():
                self._add(request_specs, joining)

    def _pin_adapters(self, specs: list[SequenceSpec]) -> list[SequenceSpec]:
        """Hold each sequence's adapter; those whose adapter cannot be had, or is not the one the
        live sequences run with, end with an error (by the next step)."""
        kept = []
        for spec in specs:
            try:
                if spec.adapter is None:
                    slot = 0
                else:
                    key, slot = self._lora.pin(spec.adapter)
                    self._pinned[spec.uid] = key
                if (self._live or self._held or self._to_prefill or kept) and slot != self._group_slot:
                    raise AdapterError(f"adapter: {spec.adapter!r} cannot join a batch of another adapter "
                                       "on this decode path")
            except AdapterError as exc:
                self._unpin(spec.uid)
                self._early.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=str(exc)))
                continue
            self._group_slot = slot
            kept.append(spec)
        return kept

    def _unpin(self, uid: str) -> None:
        key = self._pinned.pop(uid, None)
        if key is not None:
            self._lora.unpin(key)

    def _add(self, specs: list[SequenceSpec], joining: bool, prefix: Optional[PrefixCache] = None) -> None:
        groups: dict[tuple[int, ...], list[SequenceSpec]] = {}
        for spec in specs:
            groups.setdefault(tuple(spec.prompt_token_ids), []).append(spec)
        starts = plan_starts(prefix or self._prefix, {prompt: len(group) for prompt, group in groups.items()},
                             self._prefill)
        for prompt, group in groups.items():
            cache, cached, owned = starts[prompt]
            rows = [self._row(spec) for spec in group]
            rest = len(prompt) - cached
            if len(group) > 1 or (joining and self._eager_allowance >= 1 and rest <= self._eager_tokens):
                if len(group) == 1:  # a group of n pays its own prefill anyway
                    self._eager_tokens -= rest
                    self._eager_allowance -= 1
                self._start_now(list(prompt), rows, cache, cached, owned)
            elif cache is None:
                self._insert_or_hold(joining, rows, [list(prompt) for _ in rows])
            else:
                self._insert_or_hold(joining, rows, [list(prompt[cached:]) for _ in rows],
                                     _handed_out(cache, len(rows), owned), [list(prompt[:cached]) for _ in rows])

    def _prefill(self, tokens: list[int], cache: Optional[list[Any]] = None) -> list[Any]:
        """Run `tokens` through the model on top of `cache` (a fresh one if None), in place."""
        cache = make_prompt_cache(self.model) if cache is None else cache
        self._run(tokens, cache)
        return cache

    def _run(self, tokens: list[int], cache: list[Any]) -> mx.array:
        """Run `tokens` through the model on top of `cache`, in place; the last position's logits."""
        logits = None
        started = time.perf_counter()
        with mx.stream(self._generator.stream):
            for start in range(0, len(tokens), self._prefill_step_size):
                with self._lora.rows([self._group_slot]):
                    logits = self.model(mx.array(tokens[start : start + self._prefill_step_size])[None],
                                        cache=cache)
                mx.eval([c.state for c in cache])
        self._counters.add_own_prefill(len(tokens), time.perf_counter() - started)
        assert logits is not None
        return logits[:, -1, :]

    def _row(self, spec: SequenceSpec) -> "_Row":
        """A sequence's own sampler and logits processors, each guarded so that its failure ends
        that sequence alone."""
        constraint = None
        if isinstance(spec.inputs, CompiledConstraint):
            constraint = RowConstraint(spec.inputs, len(spec.prompt_token_ids), self._mask_batch())
        capture = RawLogits() if needs_raw_capture(spec, constraint is not None) else None
        guard = RowGuard()
        sampler, namer = self._samplers.get(spec.sampling, spec.choice_index)
        processors = [guard.processor(p) for p in
                      logits_processors(spec.sampling, len(spec.prompt_token_ids), capture, constraint)]
        if namer is not None:  # unguarded: it must run even after another processor of the row failed
            processors.insert(0, namer)
        return _Row(spec, capture, guard, guard.sampler(sampler), processors, constraint, version=self._version)

    def _mask_batch(self) -> MaskBatch:
        if self._masks is None:
            self._masks = MaskBatch(self._vocab_size, 2 * self._max_num_seqs)
        return self._masks

    def _fill_masks(self) -> None:
        if self._masks is not None:
            self._masks.fill()

    def _begin_step(self) -> None:
        self._samplers.seeded.begin()
        if self._masks is not None:
            self._masks.begin_step()

    def _start_now(self, prompt: list[int], rows: list["_Row"], cache: Optional[list[Any]], cached: int,
                   owned: bool) -> None:
        """Prefill the rest of the prompt here and sample each row's first token now (mlx-lm would
        prefill in one step, start decoding in the next and return the token in the third): a
        sequence joining a decoding batch gets its first token in the step it joins. The rows
        that go on continue in the batch from a copy of the prompt's cache."""
        if cache is None:
            cache = make_prompt_cache(self.model)
        elif not owned:
            cache = copy.deepcopy(cache)
        logits = self._run(prompt[cached:], cache)
        context = mx.array(prompt)
        self._begin_step()
        sampled = []
        with mx.stream(self._generator.stream):
            for row in rows:
                row_logits = logits
                for processor in row.processors:  # as mlx-lm calls them: the tokens so far, then the logits
                    row_logits = processor(context, row_logits)
                logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                sampled.append((logprobs, row.sampler(logprobs)))
            mx.eval([token for _, token in sampled])
        events, wanted, going_on = [], [], []
        for row, (logprobs, token) in zip(rows, sampled):
            spec = row.spec
            raw_logits = row.capture.pending.popleft() if row.capture is not None and row.capture.pending else None
            error = row.guard.error or (row.constraint.error if row.constraint is not None else None)
            if error is not None:
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=error))
                if row.constraint is not None:
                    row.constraint.release()
                continue
            first = int(token.item())
            finish = "stop" if first in spec.stop_token_ids else "length" if spec.max_tokens <= 1 else None
            event = TokenEvent(uid=spec.uid, token=first, index=spec.choice_index, finish_reason=finish,
                               weight_version=self._version)
            _note_constraint(row, event)
            if finish is not None and row.constraint is not None:
                row.constraint.release()
            events.append(event)
            if spec.logprobs or spec.top_logprobs:
                wanted.append((event, spec, requested_distribution(spec, logprobs[0], raw_logits)))
            if finish is None:
                row.emitted = True
                going_on.append((row, first))
        if wanted:
            attach_logprobs(wanted)
        self._early.extend(events)
        if going_on:
            caches = _handed_out(cache, len(going_on), owned=True)
            # They start from a full cache (a one-token prompt), so they need no prefill batch.
            self._hand_over([row for row, _ in going_on], [[first] for _, first in going_on], caches,
                            [list(prompt) for _ in going_on], [row.spec.max_tokens - 1 for row, _ in going_on])

    def _insert_or_hold(self, joining: bool, rows: list["_Row"], prompts: list[list[int]],
                        caches: Optional[list[list[Any]]] = None, all_tokens: Optional[list[list[int]]] = None
                        ) -> None:
        if not joining:
            self._insert(rows, prompts, caches, all_tokens)
            return
        for i, row in enumerate(rows):
            self._held.append(_Held(row, prompts[i], caches[i] if caches else None,
                                    all_tokens[i] if all_tokens else [], self._decode_steps))

    def _release_held(self) -> None:
        """Hand the held joiners to mlx-lm once a prefill batch of them waits, the oldest has waited
        long enough, or nothing else is decoding."""
        if not self._held:
            return
        full = len(self._held) >= self._prefill_batch_size
        waited = self._decode_steps - self._held[0].since_step >= JOINER_HOLD_STEPS
        if not (full or waited or not self._live):
            return
        held, self._held = self._held, []
        self._insert([h.row for h in held], [h.prompt for h in held], [h.cache for h in held],
                     [h.cached_tokens for h in held])

    def _insert(
        self,
        rows: list["_Row"],
        prompts: list[list[int]],
        caches: Optional[list[list[Any]]] = None,
        all_tokens: Optional[list[list[int]]] = None,
    ) -> None:
        """Hand sequences to mlx-lm: those with a one-token prompt (a full cache) at once, since
        mlx-lm starts them without a prefill; the others in order, a prefill batch at a time."""
        now = [i for i, prompt in enumerate(prompts) if len(prompt) <= 1]
        for i, row in enumerate(rows):
            if len(prompts[i]) > 1:
                self._to_prefill.append(_Held(row, prompts[i], caches[i] if caches else None,
                                              all_tokens[i] if all_tokens else [], self._decode_steps))
        if now:
            self._hand_over([rows[i] for i in now], [prompts[i] for i in now],
                            [caches[i] for i in now] if caches else None,
                            [all_tokens[i] for i in now] if all_tokens else None)

    def _feed_prefill(self) -> None:
        """Keep at most a prefill batch of prompts in mlx-lm's prefill, as its own cap would, and
        start none while the last batch's first tokens are still to come out where a prefill outlasts
        a decode step (see prefill_pacing.py): the call that returns them would run that prefill first
        (on a CPU, 16 prompts in batches of 8 all got their first tokens after both prefills, ~14 s,
        where the first eight can have theirs after ~7 s)."""
        room = self._prefill_batch_size - len(self._prefilling)
        if room <= 0 or not self._to_prefill:
            return
        waiting_batches = len(self._to_prefill) / self._prefill_batch_size
        if self._awaiting_first and self._pacing.hold_for_first_tokens(waiting_batches):
            return
        batch = [self._to_prefill.popleft() for _ in range(min(room, len(self._to_prefill)))]
        uids = self._hand_over([h.row for h in batch], [h.prompt for h in batch], [h.cache for h in batch],
                               [h.cached_tokens for h in batch])
        self._prefilling.update(uids)

    def _hand_over(
        self,
        rows: list["_Row"],
        prompts: list[list[int]],
        caches: Optional[list[Optional[list[Any]]]] = None,
        all_tokens: Optional[list[list[int]]] = None,
        max_tokens: Optional[list[int]] = None,
    ) -> list[int]:
        uids = self._generator.insert(
            prompts,
            max_tokens=max_tokens or [row.spec.max_tokens for row in rows],
            caches=caches,
            all_tokens=all_tokens,
            samplers=[row.sampler for row in rows],
            logits_processors=[row.processors for row in rows],
            stop_sequences=[StopSequences([[t] for t in sorted(row.spec.stop_token_ids)]) for row in rows],
        )
        for engine_uid, row in zip(uids, rows):
            self._live[engine_uid] = row
            self._engine_uid[row.spec.uid] = engine_uid
        return list(uids)

    def step(self) -> list[TokenEvent]:
        """The first tokens of sequences that just joined, if any (returned at once, so they reach
        the caller before the next decode step runs); otherwise one decode step of the batch."""
        if self._early:
            events, self._early = self._early, []
            return events
        self._release_held()
        self._feed_prefill()
        if not self._live:
            return []
        self._begin_step()
        # mlx-lm returns the tokens its previous call sampled while it launches the next forward pass:
        # after a swap, one more call's tokens come from the old weights.
        sampled_with, self._launched_with = self._launched_with, self._version
        with self._generator.stats() as window, self._lora.rows([self._group_slot]):
            progress, responses = self._generator.next()
        for prompt in progress:
            if prompt.end_of_prompt and prompt.uid in self._prefilling:
                self._prefilling.discard(prompt.uid)
                self._awaiting_first.add(prompt.uid)
        self._counters.add_generator_window(window)
        self._pacing.note(window)
        self._decode_steps += 1
        self._eager_allowance = min(EAGER_JOINERS_MAX, self._eager_allowance + 1 / EAGER_REFILL_STEPS)
        events: list[TokenEvent] = []
        wanted: list[tuple[TokenEvent, SequenceSpec, mx.array]] = []
        for response in responses:
            live = self._live.get(response.uid)
            if live is None:  # removed while its step was in flight
                continue
            spec = live.spec
            live.emitted = True
            self._awaiting_first.discard(response.uid)
            error = live.guard.error or (live.constraint.error if live.constraint is not None else None)
            if error is not None:  # this row's own code failed: end it alone
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=error))
                self.remove([spec.uid])
                continue
            event = TokenEvent(uid=spec.uid, token=int(response.token), index=spec.choice_index,
                               finish_reason=response.finish_reason, weight_version=sampled_with)
            _note_constraint(live, event)
            events.append(event)
            raw_logits = live.capture.pending.popleft() if live.capture is not None else None
            if spec.logprobs or spec.top_logprobs:
                wanted.append((event, spec, requested_distribution(spec, response.logprobs, raw_logits)))
            if response.finish_reason is not None:
                if live.version == self._version:  # else its cache holds keys and values of older weights
                    self._keep_cache(spec, response.all_tokens, response.prompt_cache)
                self._forget(spec.uid)
        if wanted:
            attach_logprobs(wanted)
        return events

    def _keep_cache(self, spec: SequenceSpec, tokens: Optional[list[int]], cache: Optional[list[Any]]) -> None:
        """Offer a finished sequence's cache (its prompt and output) to the prefix cache, if it
        holds what we think: the prompt first, one cached position per token."""
        if not self._prefix.enabled or tokens is None or cache is None or spec.adapter is not None:
            return
        prompt = spec.prompt_token_ids
        if len(tokens) > len(prompt) and tokens[: len(prompt)] == prompt:
            self._prefix.store(list(tokens), cache, speculative=True)

    def remove(self, uids: list[str]) -> None:
        if self._held or self._to_prefill:
            gone = set(uids)
            self._held = [h for h in self._held if h.row.spec.uid not in gone]
            self._to_prefill = deque(h for h in self._to_prefill if h.row.spec.uid not in gone)
        engine_uids = [self._engine_uid[u] for u in uids if u in self._engine_uid]
        if engine_uids:
            self._generator.remove(engine_uids)
        for uid in uids:
            self._forget(uid)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _forget(self, uid: str) -> None:
        self._unpin(uid)
        engine_uid = self._engine_uid.pop(uid, None)
        if engine_uid is not None:
            row = self._live.pop(engine_uid, None)
            if row is not None and row.constraint is not None:
                row.constraint.release()
            self._prefilling.discard(engine_uid)
            self._awaiting_first.discard(engine_uid)


@dataclass
class _Held:
    """A sequence not yet handed to mlx-lm: a joiner waiting for the others of its prefill batch,
    or a prompt waiting for room in mlx-lm's prefill."""

    row: "_Row"
    prompt: list[int]  # the tokens still to prefill
    cache: Optional[list[Any]]  # what it starts from (a cached prefix), or None
    cached_tokens: list[int]  # the tokens that cache holds
    since_step: int  # the engine's decode step count when it arrived


@dataclass
class _Row:
    """One sequence's own state in the batch: its spec, sampler, processors and their guard."""

    spec: SequenceSpec
    capture: Optional["RawLogits"]
    guard: "RowGuard"
    sampler: Any
    processors: list[Any]
    constraint: Optional[RowConstraint] = None
    emitted: bool = False  # it has produced a token
    version: int = 0  # of the weights when it was made: a cache it leaves is that version's only if unchanged


def _by_request(specs: list[SequenceSpec]) -> dict[str, list[SequenceSpec]]:
    by_request: dict[str, list[SequenceSpec]] = {}
    for spec in specs:
        by_request.setdefault(spec.request_id, []).append(spec)
    return by_request


def _handed_out(cache: list[Any], count: int, owned: bool) -> list[list[Any]]:
    """`count` caches for sequences to start from: `cache` itself first if it is ours to give
    (copies cost a device copy per layer), copies for the others."""
    return [cache if owned and i == 0 else copy.deepcopy(cache) for i in range(count)]


def _note_constraint(row: "_Row", event: TokenEvent) -> None:
    """Tell a constrained row's matcher what it returned, and on its last token whether its text is complete."""
    if row.constraint is None:
        return
    row.constraint.observe(event.token)
    if event.finish_reason is not None:
        event.constraint_complete = row.constraint.ended(stopped_by_token=event.finish_reason == "stop")
