"""Text engine: mlx-lm's BatchGenerator (continuous batching) behind the Engine protocol.

Uses only mlx-lm's public API: `BatchGenerator.insert/next/remove` (insert with `caches` and
`all_tokens` to start a sequence from a KV cache), `StopSequences`, `models.cache`, and (through
worker/engines/sampling.py) `sample_utils`.

Prompts reuse KV caches across requests through worker/engines/prefix_cache.py: a sequence whose prompt
starts with tokens the cache holds enters the batch with a copy of their cache and prefills only
the rest; finished sequences leave their cache (prompt and output) behind for later ones.

A sequence that joins a batch already decoding, and the n choices of one request, are prefilled
here at admission and their first tokens sampled from that prefill (see `_start_now`); the rest of
a burst goes through mlx-lm's batched prefill. Each sequence's row (its sampler, processors, first
token) is worker/engines/text_rows.py's; the sequences waiting to enter mlx-lm's batch, and when
they may, are worker/engines/prefill_queue.py's.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from schemas import GenerationRequest
from worker.adapters import AdapterCatalog, AdapterError
from worker.engines.base import EngineStats, Prompt, SequenceSpec, TokenEvent
from worker.engines.prompt_scores import PromptScorer
from worker.engines.weight_swap import ParameterSpec, parameter_spec, swap_into
from worker.engines.constraints import ConstraintCompiler
from worker.engines.counters import EngineCounters
from worker.engines.lora import LoraBank
from worker.engines.prefill_queue import PrefillQueue
from worker.engines.prefix_cache import PrefixCache, plan_starts, unsupported_reason
from worker.engines.sampling import attach_logprobs, greedy, repair_random_state, requested_distribution
from worker.engines.constraints import finish_token
from worker.engines.text_rows import Row, RowMaker
from worker.engines.text_model import (ChatFormat, RequestRejected, measure_kv_bytes_per_token,  # noqa: F401
                                       model_context_length, model_vocab_size, prepare_prompt)


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
        tool_call_format: str = "auto",
        reasoning: str = "auto",
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
        self._generator_options = dict(
            sampler=greedy,
            completion_batch_size=max_num_seqs,
            # mlx-lm's own cap would also meter sequences that start from a full cache (the n choices
            # of a request, joiners prefilled here), which need no prefill, so that they would enter
            # one a step. This engine meters the prompts that do need a prefill itself (prefill_queue.py).
            prefill_batch_size=max_num_seqs,
            prefill_step_size=prefill_step_size,
        )
        self._generator = BatchGenerator(model, **self._generator_options)
        self._prefill_step_size = prefill_step_size
        self._live: dict[int, Row] = {}
        self._early: list[TokenEvent] = []  # first tokens sampled at admission, returned by the next step
        # Sequences not in mlx-lm's batch yet: joiners held, prompts waiting for room in its prefill.
        self._waiting = PrefillQueue(min(prefill_batch_size, max_num_seqs), prefill_step_size)
        self._engine_uid: dict[str, int] = {}
        self._rows = RowMaker(self._vocab_size, max_num_seqs)
        self._constraints = ConstraintCompiler(tokenizer, self._vocab_size, self._eos)
        self._chat = ChatFormat(tokenizer, tool_call_format=tool_call_format, reasoning=reasoning)
        self._counters = EngineCounters()
        self._version = 0  # of the weights now (swap_weights)
        self._launched_with = 0  # the version mlx-lm's last call launched its forward pass with
        self._kv_bytes_per_token = measure_kv_bytes_per_token(model)
        self._prefix = PrefixCache(prefix_cache_bytes, min_match=prefix_min_match,
                                   disabled_reason=unsupported_reason(make_prompt_cache(model)))
        self._scorer = PromptScorer(model, self._vocab_size, prefill_step_size, self._lora.rows, self._counters)

    # Prompts are scored (GenerationRequest.prompt_logprobs) in `add` (worker/engines/prompt_scores.py).
    serves_prompt_logprobs = True

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def num_active(self) -> int:
        return len(self._live) + len(self._waiting)

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
        self._scorer.clear()
        self._waiting.clear()
        self._prefix.clear()  # after a failed step nothing it made is trusted
        self._lora.unpin_all()
        self._pinned.clear()
        self._group_slot = 0
        self._rows.reset()
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
        self._waiting.prefill_whole()

    def reset_prefix_cache(self) -> None:
        self._prefix.clear()

    def parameter_spec(self) -> ParameterSpec:
        return parameter_spec(self.model)

    def prepare(self, request: GenerationRequest) -> Prompt:
        """The prompt's token ids and, for a constrained request, its compiled constraint (cached
        per worker: docs/structured-output.md has the compile times)."""
        prompt = prepare_prompt(self._chat, request, self._constraints)
        if request.adapter is not None:
            self._lora.check(request.adapter)  # read now, so a bad adapter fails its job at once
        return prompt

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        return self._chat.prompt_ids(request)

    def add(self, specs: list[SequenceSpec]) -> None:
        """Queue sequences, in order. Sequences with the same prompt (a request's n choices) share
        one prefill: the prompt but its last token is run once and each starts from a copy of its KV
        cache. With the prefix cache on, every prompt first takes the longest cached prefix, and
        prompts of one `add` (the scheduler adds a round at once) share their common prefixes'
        prefills; with it off, nothing is shared across requests."""
        # A batch is decoding (not just prefilling a burst that came over two steps): these join it.
        joining = any(row.emitted for row in self._live.values())
        self._waiting.begin_add()
        specs = self._score_prompts(self._pin_adapters(specs), joining)
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
                if (self._live or self._waiting or kept) and slot != self._group_slot:
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
            self._start_group(list(prompt), group, joining, *starts[prompt])

    def _start_group(self, prompt: list[int], group: list[SequenceSpec], joining: bool, cache: Optional[list[Any]],
                     cached: int, owned: bool) -> None:
        """Sequences with the same prompt, whose first `cached` tokens `cache` holds, into the batch."""
        rows = [self._rows.row(spec, self._version) for spec in group]
        rest = len(prompt) - cached
        # A group of n pays its own prefill anyway; a lone joiner draws on the eager allowance.
        if len(group) > 1 or (joining and self._waiting.take_eager(rest)):
            self._start_now(prompt, rows, cache, cached, owned)
        elif cache is None:
            self._insert_or_hold(joining, rows, [list(prompt) for _ in rows])
        else:
            self._insert_or_hold(joining, rows, [prompt[cached:] for _ in rows],
                                 _handed_out(cache, len(rows), owned), [prompt[:cached] for _ in rows])

    def _score_prompts(self, specs: list[SequenceSpec], joining: bool) -> list[SequenceSpec]:
        """The sequences that asked for their prompt's logprobs, scored (worker/engines/prompt_scores.py):
        those that only asked that end now, the others start from the scoring's cache; the rest
        are returned for the ordinary path."""
        if all(spec.prompt_logprobs is None for spec in specs):
            return specs
        with mx.stream(self._generator.stream):
            taken = self._scorer.take(specs, self._group_slot)
        self._early += taken.ended
        for event in taken.ended:
            self._unpin(event.uid)
        for group in taken.going_on:
            self._start_group(group.prompt, group.specs, joining, group.cache, group.cached, True)
        return taken.rest

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

    def _start_now(self, prompt: list[int], rows: list[Row], cache: Optional[list[Any]], cached: int,
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
        events, going_on = self._rows.first_tokens(rows, logits, mx.array(prompt), self._generator.stream,
                                                   self._version)
        self._early.extend(events)
        if going_on:
            caches = _handed_out(cache, len(going_on), owned=True)
            # They start from a full cache (a one-token prompt), so they need no prefill batch.
            self._hand_over([row for row, _ in going_on], [[first] for _, first in going_on], caches,
                            [list(prompt) for _ in going_on], [row.spec.max_tokens - 1 for row, _ in going_on])

    def _insert_or_hold(self, joining: bool, rows: list[Row], prompts: list[list[int]],
                        caches: Optional[list[list[Any]]] = None, all_tokens: Optional[list[list[int]]] = None
                        ) -> None:
        if joining:
            self._waiting.hold(rows, prompts, caches, all_tokens)
        else:
            self._insert(rows, prompts, caches, all_tokens)

    def _insert(
        self,
        rows: list[Row],
        prompts: list[list[int]],
        caches: Optional[list[list[Any]]] = None,
        all_tokens: Optional[list[list[int]]] = None,
    ) -> None:
        """Hand sequences to mlx-lm: those with a one-token prompt (a full cache) at once, since
        mlx-lm starts them without a prefill; the others in order, a prefill batch at a time."""
        now = self._waiting.queue(rows, prompts, caches, all_tokens)
        if now:
            self._hand_over([rows[i] for i in now], [prompts[i] for i in now],
                            [caches[i] for i in now] if caches else None,
                            [all_tokens[i] for i in now] if all_tokens else None)

    def _hand_waiting_over(self) -> None:
        """The held joiners once they may go (`PrefillQueue.release`), then the next prefill batch."""
        released = self._waiting.release(bool(self._live))
        if released:
            self._insert([h.row for h in released], [h.prompt for h in released], [h.cache for h in released],
                         [h.cached_tokens for h in released])
        batch = self._waiting.next_prefill_batch()
        if batch:
            self._waiting.prefilling(self._hand_over([h.row for h in batch], [h.prompt for h in batch],
                                                     [h.cache for h in batch], [h.cached_tokens for h in batch]))

    def _hand_over(
        self,
        rows: list[Row],
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
            return self._scorer.attach(events)
        self._hand_waiting_over()
        if not self._live:
            return []
        self._rows.begin_step()
        # mlx-lm returns the tokens its previous call sampled while it launches the next forward pass:
        # after a swap, one more call's tokens come from the old weights.
        sampled_with, self._launched_with = self._launched_with, self._version
        with self._generator.stats() as window, self._lora.rows([self._group_slot]):
            progress, responses = self._generator.next()
        self._waiting.stepped(progress, window)
        self._counters.add_generator_window(window)
        events: list[TokenEvent] = []
        wanted: list[tuple[TokenEvent, SequenceSpec, mx.array]] = []
        for response in responses:
            live = self._live.get(response.uid)
            if live is None:  # removed while its step was in flight
                continue
            spec = live.spec
            live.emitted = True
            self._waiting.first_token_out(response.uid)
            error = live.error
            if error is not None:  # this row's own code failed: end it alone
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=error))
                self.remove([spec.uid])
                continue
            event = finish_token(live.constraint, TokenEvent(
                uid=spec.uid, token=int(response.token), index=spec.choice_index,
                finish_reason=response.finish_reason, weight_version=sampled_with))
            events.append(event)
            raw_logits = live.capture.pending.popleft() if live.capture is not None else None
            if event.error is None and (spec.logprobs or spec.top_logprobs):
                wanted.append((event, spec, requested_distribution(spec, response.logprobs, raw_logits)))
            if response.finish_reason is not None:
                if live.version == self._version:  # else its cache holds keys and values of older weights
                    self._keep_cache(spec, response.all_tokens, response.prompt_cache)
                self._forget(spec.uid)
        if wanted:
            attach_logprobs(wanted)
        return self._scorer.attach(events)

    def _keep_cache(self, spec: SequenceSpec, tokens: Optional[list[int]], cache: Optional[list[Any]]) -> None:
        """Offer a finished sequence's cache (its prompt and output) to the prefix cache, if it
        holds what we think: the prompt first, one cached position per token."""
        if not self._prefix.enabled or tokens is None or cache is None or spec.adapter is not None:
            return
        prompt = spec.prompt_token_ids
        if len(tokens) > len(prompt) and tokens[: len(prompt)] == prompt:
            self._prefix.store(list(tokens), cache, speculative=True)

    def remove(self, uids: list[str]) -> None:
        self._waiting.remove(set(uids))
        engine_uids = [self._engine_uid[u] for u in uids if u in self._engine_uid]
        if engine_uids:
            self._generator.remove(engine_uids)
        for uid in uids:
            self._forget(uid)
        self._scorer.forget(uids)

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
            self._waiting.forget(engine_uid)


def _by_request(specs: list[SequenceSpec]) -> dict[str, list[SequenceSpec]]:
    by_request: dict[str, list[SequenceSpec]] = {}
    for spec in specs:
        by_request.setdefault(spec.request_id, []).append(spec)
    return by_request


def _handed_out(cache: list[Any], count: int, owned: bool) -> list[list[Any]]:
    """`count` caches for sequences to start from: `cache` itself first if it is ours to give
    (copies cost a device copy per layer), copies for the others."""
    return [cache if owned and i == 0 else copy.deepcopy(cache) for i in range(count)]
