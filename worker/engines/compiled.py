"""CompiledEngine: mlxq's own continuous-batching decode loop over shape-stable slot buffers.

Every sequence owns a slot of preallocated per-layer KV buffers (worker/engines/slot_cache.py)
and is written at its own position, so a decode step has the same shapes whatever the sequences'
lengths: it is one `mx.compile`d call per (slots, length) bucket (worker/engines/decode_step.py).
The next step is built and handed to the device (`mx.async_eval`) before the tokens of the one in
flight are read back, so the host's work for step k+1 runs while the device computes step k; a
step's tokens are therefore returned by the following `step()` call.

Prompts are prefilled a prefill batch at a time into their slots (worker/engines/compiled_admission.py,
worker/engines/slot_prefill.py).
On CUDA the prefill takes every prompt token and the first generated token is sampled from its
logits at the last one (as mlx-lm's BatchGenerator does), so a sequence joining a decoding batch
needs no decode step before its first token. Elsewhere, and for prompts with nothing to prefill but
their last token, it takes every token but the last, whose token enters the next decode step (as
mlx-lm's `generate_step` does), which samples the first token. Sampling, logits processors, seeds,
logprobs, the prefix cache and the n choices sharing one prefill are the text engine's
(worker/engines/text.py): the same modules, the same per-row rules, in the order mlx-lm applies them.

With a speculator (worker/engines/speculation/, docs/speculative.md) rows propose their next tokens
and a step may instead be one verification pass over every slot's input and proposal, read back at
once; a row keeps what the model confirms.

Models whose caches are not plain `KVCache`s, or whose layers this cache does not serve exactly,
run on mlx-lm's BatchGenerator instead: worker/engines/decode_path.py decides.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from schemas import GenerationRequest
from worker.adapters import AdapterCatalog
from worker.engines.base import EngineStats, Prompt, SequenceSpec, TokenEvent
from worker.engines.constraints import ConstraintCompiler, finish_token
from worker.engines.prompt_scores import PromptScorer
from worker.engines.counters import EngineCounters
from worker.engines.compiled_admission import Admission
from worker.engines.compiled_rows import DecodingSequence, LaunchedStep
from worker.engines.decode_step import MIN_LENGTH_BUCKET, CompileRecord, DecodeStep, ladder
from worker.engines.lora import LoraBank
from worker.engines.prefix_cache import PrefixCache, unsupported_reason
from worker.engines.step_sampling import StepSampler
from worker.engines.sampling import repair_random_state
from worker.engines.slot_cache import KVLayout
from worker.engines.slot_prefill import SlotPrefill
from worker.engines.slot_table import SlotTable
from worker.engines.speculation.pass_cost import Call
from worker.engines.speculation.speculator import Speculator, StepPlan
from worker.engines.speculation.verify_pass import VerificationPass
from worker.engines.text_model import ChatFormat, model_context_length, model_vocab_size, prepare_prompt
from worker.engines.weight_swap import ParameterSpec, parameter_spec, swap_into

log = logging.getLogger("mlxq.engine")

# Reading back the step that samples the first tokens of sequences that join a decoding batch, in
# the call that admits them, costs the overlap of that step with the host's next one; under
# steady churn (sequences joining every step) that would be every step. At most EAGER_MAX such
# calls at once; one more is allowed per EAGER_REFILL_STEPS decode steps. Other joiners get their
# first token one call later. (Only where a decode step samples first tokens: see below.)
EAGER_MAX = 4
EAGER_REFILL_STEPS = 16

# Whether the prefill samples the first token, unless the caller says: on CUDA, where each model
# call costs the host milliseconds of kernel launches however few its rows, and the vocabulary
# projection at every prompt position costs the device little (docs/engine.md, "First tokens"). The
# CPU and Metal, where that was not measured to pay, keep the decode step.
def first_token_from_prefill_by_default() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


class CompiledEngine:
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
        kv_budget_bytes: int = 0,
        overlap: bool = True,
        adapters: Optional[AdapterCatalog] = None,
        adapter_memory_bytes: int = 0,
        tool_call_format: str = "auto",
        reasoning: str = "auto",
        first_token_from_prefill: Optional[bool] = None,
        speculator: Optional[Speculator] = None,
    ) -> None:
        self.model = model
        # LoRA adapters per row (worker/engines/lora.py): its state is an input of the compiled step.
        self._lora = LoraBank(model, adapters or AdapterCatalog(), adapter_memory_bytes)
        self._overlap = overlap  # False: every step is read back in the call that launched it
        self.tokenizer = tokenizer
        self._vocab_size = model_vocab_size(model, tokenizer)
        self._eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._max_slots = max_num_seqs
        self._layout = KVLayout.of(model)
        self._decode = DecodeStep(model, self._layout.grouped_mask, extra_inputs=self._lora.state)
        self._prefill = SlotPrefill(model, self._lora, self._layout.grouped_mask, prefill_step_size)
        self._sampling = StepSampler(self._vocab_size, self._max_slots)
        self._constraints = ConstraintCompiler(tokenizer, self._vocab_size, self._eos)
        self._chat = ChatFormat(tokenizer, tool_call_format=tool_call_format, reasoning=reasoning)
        self._version = 0  # of the weights now (swap_weights)
        self._counters = EngineCounters()
        self._prefix = PrefixCache(prefix_cache_bytes, min_match=prefix_min_match,
                                   disabled_reason=unsupported_reason(make_prompt_cache(model)))
        # A draft model's keys and values share the budget in proportion to the bytes per token: each
        # table then sizes its buffers exactly where both tables' buckets together would pass it.
        own_budget = kv_budget_bytes
        if speculator is not None:
            own_bytes = self._layout.bytes_per_token
            own_budget = kv_budget_bytes * own_bytes // (own_bytes + speculator.drafter.kv_bytes_per_token)
            speculator.drafter.share_kv_budget(kv_budget_bytes - own_budget)
        self._table: SlotTable[DecodingSequence] = SlotTable(self._layout, max_num_seqs, own_budget)
        self._by_uid: dict[str, DecodingSequence] = {}
        self._in_flight: Optional[LaunchedStep] = None
        self._eager_allowance = float(EAGER_MAX)
        self._scorer = PromptScorer(model, self._vocab_size, prefill_step_size, self._lora.rows, self._counters)
        self._admission = Admission(
            self._table, self._prefill, self._lora, self._prefix, self._scorer, self._counters, self._sequence,
            logits_bytes_per_token=self._vocab_size * self._layout.dtype.size,
            prefill_batch_size=min(prefill_batch_size, max_num_seqs), prefill_step_size=prefill_step_size,
            first_at_prefill=(first_token_from_prefill_by_default() if first_token_from_prefill is None
                              else first_token_from_prefill))
        self._prebuild: Optional[Any] = None  # a KernelPrebuild (prebuild_kernels)
        # Speculative decoding (docs/speculative.md): the policy, and the verification pass over its proposals.
        self._spec = speculator
        self._verification = (VerificationPass(model, self._layout.grouped_mask, self._lora, speculator)
                              if speculator is not None else None)
        self._jobs_waiting = True  # in the worker's queues, as its latest poll found (queue_seen)

    # --- the Engine protocol --------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def num_active(self) -> int:
        return len(self._by_uid)

    @property
    def speculator(self) -> Optional[Speculator]:
        return self._spec

    @property
    def kv_bytes_per_token(self) -> int:
        """The served model's keys and values per row and token, and a draft model's (its own slot
        buffers, sized as the engine's are)."""
        return self._layout.bytes_per_token + (self._spec.drafter.kv_bytes_per_token if self._spec else 0)

    def kv_bytes_for(self, rows: int, tokens: int) -> int:
        """The slot buffers' bytes when `rows` sequences of up to `tokens` tokens decode: what
        admission should count (the buckets pad both)."""
        slots, length = self._table.shape_for(rows, tokens)
        return slots * length * self.kv_bytes_per_token

    @property
    def context_length(self) -> Optional[int]:
        return model_context_length(self.model)

    @property
    def weight_version(self) -> int:
        return self._version

    def swap_weights(self, files: list[Path], version: int) -> None:
        """The next step reads the new weights (they are the compiled step's inputs); the step in
        flight ran with the old ones, and its tokens say so."""
        swap_into(self.model, files)  # all or nothing
        self._version = version
        self._prefix.clear()  # its caches hold the old weights' keys and values
        if self._spec is not None:
            self._spec.reset()  # acceptance learnt under the old weights, and draft caches, start over
        self._admission.prefill_whole()

    def reset_prefix_cache(self) -> None:
        self._prefix.clear()

    def parameter_spec(self) -> ParameterSpec:
        return parameter_spec(self.model)

    def prepare(self, request: GenerationRequest) -> Prompt:
        prompt = prepare_prompt(self._chat, request, self._constraints)
        if request.adapter is not None:
            self._lora.check(request.adapter)  # read now, so a bad adapter fails its job at once
        return prompt

    # Prompts are scored (GenerationRequest.prompt_logprobs) in `add` (worker/engines/prompt_scores.py).
    serves_prompt_logprobs = True

    # Rows of different adapters (and base rows) decode in one step.
    adapter_batching = "rows"
    adapter_refusal = ""

    @property
    def adapters(self) -> LoraBank:
        return self._lora

    def register_adapter(self, name: str, directory: Path) -> None:
        """A published adapter is ready in `directory`: requests naming it use it from now on."""
        self._lora.publish(name, directory)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def stats(self) -> EngineStats:
        counters: dict[str, Any] = dict(self._counters.as_dict())
        counters.update(compiled_shapes=len(self._decode.shapes), compile_s=self._decode.compile_seconds,
                        uncompiled_steps=self._decode.uncompiled_steps,
                        kernels_prebuilding=int(self._prebuild is not None and not self._prebuild.done),
                        slot_buffer_bytes=self._table.buffers.nbytes if self._table.buffers else 0, **self._lora.stats())
        if self._spec is not None:
            counters.update(self._spec.stats())
        return EngineStats(counters=counters, prefix_cache=self._prefix.stats())

    def time_stats(self) -> dict[str, Any]:
        return self._counters.as_dict()

    def prefix_cache_stats(self) -> dict[str, Any]:
        return self._prefix.stats()

    @property
    def compiled_shapes(self) -> list[tuple[int, int]]:
        """The (slots, length) shapes the decode step is compiled for, in the order compiled."""
        return list(self._decode.shapes)

    @property
    def compile_records(self) -> list[CompileRecord]:
        """How long each shape took to compile, and whether the warm-up or a running batch did it."""
        return list(self._decode.shapes.values())

    def warm_up_shapes(self, max_tokens: int, slots: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
        """Every slot bucket up to max_num_seqs (or those of `slots`) at every length bucket up to
        `max_tokens`, shortest first (the first two hold every kernel: worker/engines/kernel_prebuild.py)."""
        buckets = self._table.ladder() if slots is None else sorted({self._table.shape_for(n, 1)[0] for n in slots})
        return [(n, length) for length in ladder(max_tokens, MIN_LENGTH_BUCKET) for n in buckets]

    def warm_up(self, max_tokens: int, slots: Optional[Sequence[int]] = None) -> tuple[int, float]:
        """Compile the decode step for `warm_up_shapes` now (and the verification pass for the first
        two, which build its kernels), and run one lone prompt's prefill (on
        CUDA the first run of its kernels took 0.4 s, a stall for a batch the first joiner would
        join): how many shapes, and the seconds it took. Serving waits for it; `prebuild_kernels`
        does not."""
        shapes = self.warm_up_shapes(max_tokens, slots)
        seconds = self._decode.warm_up(self._layout, shapes)
        if self._verification is not None:
            started = time.perf_counter()
            for slot_count, length in shapes[:2]:
                self._verification.warm_up(self._layout, slot_count, length, self._verify_widths())
            seconds += time.perf_counter() - started
        return len(shapes), seconds + self.warm_up_prefill(max_tokens)

    def warm_up_prefill(self, max_tokens: int) -> float:
        """Run one lone prompt's prefill (uncompiled, so quick; on CUDA its first run in a process
        took 0.4 s, a stall for the batch the first joiner would join): the seconds it took."""
        started = time.perf_counter()
        cache, logits = self._prefill.on_own_cache([0] * min(max_tokens, MIN_LENGTH_BUCKET))
        mx.eval(logits[:, -1, :], [c.state for c in cache])
        return time.perf_counter() - started

    def prebuild_kernels(self, model_dir: str, max_tokens: int) -> None:
        """Build the kernels of `warm_up_shapes(max_tokens)` in a background process
        (worker/engines/kernel_prebuild.py) from `model_dir`, the served model's directory; until
        a shape's are built, its steps run uncompiled."""
        from worker.engines.kernel_prebuild import KernelPrebuild, served_formats

        upcast, keep_quantized = served_formats(self.model)
        self._prebuild = KernelPrebuild(model_dir, self.warm_up_shapes(max_tokens), upcast=upcast,
                                        keep_quantized=keep_quantized, grouped_mask=self._layout.grouped_mask,
                                        verify_widths=self._verify_widths())
        self._decode.may_compile = self._prebuild.ready
        if mx.default_device().type != mx.DeviceType.cpu:  # the CPU's prefill builds no kernels: nothing to gain
            self.warm_up_prefill(max_tokens)

    def close(self) -> None:
        """Stop the kernel prebuild, if it still runs."""
        if self._prebuild is not None:
            self._prebuild.stop()

    def add(self, specs: list[SequenceSpec]) -> None:
        """Queue sequences, in order. Sequences with the same prompt (a request's n choices) share
        one prefill of the prompt but its last token. With the prefix cache on, every prompt first
        takes the longest cached prefix, and prompts of one `add` share their common prefixes'
        prefills; with it off, nothing is shared across requests."""
        for seq in self._admission.add(specs):
            self._by_uid[seq.spec.uid] = seq

    def step(self) -> list[TokenEvent]:
        """One step (`_step`); a scored prompt's scores go on its sequence's first event."""
        return self._scorer.attach(self._step())

    def _step(self) -> list[TokenEvent]:
        """Admit waiting prompts (a prefill batch), hand the next decode step to the device, and
        return the tokens of the step handed over by the previous call.

        Sequences just admitted get their first token in this call. Where their prefill sampled it
        and no other prompt waits, the call returns those tokens at once and launches nothing: the
        step in flight stays in flight for the next call to read back, so the batch keeps its
        overlap and a joiner's first token waits for its own prefill alone. Where a decode step
        samples it, that step is read back at once while the eager allowance lasts (or when
        nothing was decoding) and the call returns without launching another; the next call
        launches and returns nothing of its own."""
        started = time.perf_counter()
        refused = self._admission.take_refused()
        decoding = self._table.any_occupied()
        prefill_s, first, stepping = self._admission.admit(self._sampling, self._version)
        waiting = self._admission.waiting
        if first is not None and not stepping and not waiting:
            events = refused + self._collect(first)
            self._count(events, started, prefill_s, Call.OTHER)
            return events
        self._table.fit(waiting=bool(waiting))
        previous, self._in_flight = self._in_flight, None
        events = refused
        admitted = first is not None or stepping or prefill_s
        read_early = False  # the step in flight read back early for a pass (a declined look if none then runs)
        if self._spec is not None:
            occupied = self._table.occupied()
            self._spec.step_began(occupied, len(self._table.slots),
                                  backlog=bool(waiting) or (self._jobs_waiting and len(occupied) >= self._max_slots))
            # Until the verification pass's kernels are built a pass would stall the batch for seconds.
            verify_ready = self._prebuild is None or self._prebuild.verify_ready
            if verify_ready and self._spec.wants(occupied, len(self._table.slots), in_flight=previous is not None):
                # A proposal continues each row's latest token: read back the steps that made them first.
                read_early = previous is not None
                events += (self._collect(previous) if previous is not None else [])
                events += (self._collect(first) if first is not None else [])
                previous = first = None
                slots = len(self._table.slots)
                plan = self._spec.plan(self._table.occupied(), slots)
                if plan is not None:
                    events += self._verify_plan(plan)
                    assert self._verification is not None
                    timed = not admitted and not self._verification.traced
                    if not self._table.any_occupied() and not waiting:
                        self._table.release()
                    self._count(events, started, prefill_s, Call.PASS if timed else Call.OTHER,
                                slots=slots, width=plan.width)
                    return events
        launched = self._launch() if self._table.any_occupied() else None
        # A step's worth of time: one launched and (with overlap) the one before read back, nothing admitted.
        plain = launched is not None and not admitted
        kind = (Call.OTHER if not plain else Call.DECLINED if read_early
                else Call.STEP if (previous is not None) == self._overlap else Call.RESTART)
        events += (self._collect(previous) if previous is not None else [])
        if first is not None:
            events += self._collect(first)
        eager = stepping > 0 and (not decoding or self._eager_allowance >= 1)
        if launched is not None and (eager or not self._overlap):
            self._eager_allowance -= bool(eager and decoding and self._overlap)
            events += self._collect(launched)
            launched = None
        self._in_flight = launched
        slots = len(self._table.slots)
        if not self._table.any_occupied() and not waiting:  # idle: give the buffers' memory back
            self._table.release()
        self._count(events, started, prefill_s, kind, slots=slots)
        return events

    def _count(self, events: list[TokenEvent], started: float, prefill_s: float, kind: Call, *, slots: int = 0,
               width: int = 0) -> None:
        """Count the call's tokens and time, and tell the pass costs what the call was (pass_cost.py)."""
        self._counters.decode_tokens += sum(1 for e in events if e.error is None)
        self._counters.decode_s += time.perf_counter() - started - prefill_s
        if self._spec is not None:
            self._spec.costs.call(started, kind, slots, width)

    def queue_seen(self, jobs_waiting: bool) -> None:
        """Whether jobs wait in the worker's queues, as its latest poll found: with every slot taken, a
        row that ends sooner frees its slot for one only if some wait."""
        self._jobs_waiting = jobs_waiting

    def remove(self, uids: list[str]) -> None:
        gone = set()
        self._scorer.forget(uids)
        for uid in uids:
            seq = self._by_uid.get(uid)
            if seq is not None:
                gone.add(id(seq))
                self._end(seq)
        if gone:
            self._admission.drop(gone)

    def reset(self) -> None:
        self._table.release()
        self._admission.clear()
        self._by_uid.clear()
        self._in_flight = None
        self._prefix.clear()  # after a failed step nothing it made is trusted
        self._lora.unpin_all()
        self._scorer.clear()
        self._sampling = StepSampler(self._vocab_size, self._max_slots)
        if self._spec is not None:
            self._spec.reset()
        repair_random_state()

    # --- a sequence's own state ---------------------------------------------------------------
    def _sequence(self, spec: SequenceSpec) -> DecodingSequence:
        """A sequence's own sampler and logits processors (worker/engines/step_sampling.py)."""
        row = self._sampling.row(spec)
        return DecodingSequence(row.guard, row.sampler, row.processors, row.constraint, row.custom, row.seeded,
                                row.seeded_row,
                                spec=spec, prompt=list(spec.prompt_token_ids), version=self._version,
                                context=mx.array(spec.prompt_token_ids) if row.custom else None)

    # --- decoding -------------------------------------------------------------------------
    def _launch(self) -> LaunchedStep:
        table = self._table
        assert table.buffers is not None and table.inputs is not None
        occupied = table.occupied()
        self._sampling.begin(occupied, table.inputs)  # constrained rows' masks, while the step is built
        positions = [0] * len(table.slots)
        adapter_slots = [0] * len(table.slots)
        for seq in occupied:
            positions[seq.slot] = seq.position
            adapter_slots[seq.slot] = seq.adapter_slot
        inputs = table.inputs
        table.buffers.check_room(positions, 1)
        with self._lora.rows(adapter_slots):
            logits = self._decode(inputs, mx.array(positions, dtype=mx.int32), table.buffers)
        tokens, gather, wanting = self._sampling.sample(logits, inputs, occupied, len(table.slots))
        errors = [seq.error for seq in occupied]
        for seq in occupied:
            seq.position += 1
            seq.launches += 1
        table.inputs = tokens
        self._counters.decode_steps += 1
        self._eager_allowance = min(EAGER_MAX, self._eager_allowance + 1 / EAGER_REFILL_STEPS)
        mx.async_eval(tokens, *(gather.arrays if gather is not None else ()), *table.buffers.arrays())
        return LaunchedStep(tokens, [(seq.slot, seq) for seq in occupied], errors, gather, wanting, self._version)

    def _collect(self, launched: LaunchedStep) -> list[TokenEvent]:
        """Read a launched step's tokens back and turn them into events; end the sequences that
        stopped, hit their length or failed."""
        tokens = launched.tokens.tolist()
        events: list[TokenEvent] = []
        wanted_events: list[Optional[TokenEvent]] = [None] * len(launched.wanting)
        wanted_at = {row: i for i, row in enumerate(launched.wanting)}
        for i, (slot, seq) in enumerate(launched.rows):
            if seq.done:  # removed, or ended by an earlier step, while this one was in flight
                continue
            spec = seq.spec
            if launched.errors[i] is not None:
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=launched.errors[i]))
                self._end(seq)
                continue
            event = self._emit(seq, int(tokens[slot]), launched.weight_version)
            events.append(event)
            if event.error is None and i in wanted_at:
                wanted_events[wanted_at[i]] = event
        if launched.logprobs is not None:
            launched.logprobs.fill(wanted_events)
        return events

    def _emit(self, seq: DecodingSequence, token: int, weight_version: int) -> TokenEvent:
        """`seq`'s next token: its event; the sequence ends on a stop token, its length or its
        constraint's failure."""
        spec = seq.spec
        seq.generated.append(token)
        finish = ("stop" if token in spec.stop_token_ids
                  else "length" if len(seq.generated) >= spec.max_tokens else None)
        event = finish_token(seq.constraint, TokenEvent(uid=spec.uid, token=token, index=spec.choice_index,
                                                        finish_reason=finish, weight_version=weight_version))
        if event.error is not None:
            self._end(seq)
        elif finish is not None:
            self._keep_cache(seq)
            self._end(seq)
        return event

    # --- speculative decoding (docs/speculative.md) ------------------------------------------
    def _verify_widths(self) -> list[int]:
        """The widths a verification pass can take (1 + a proposal of 1 to k tokens); none without speculation."""
        return list(range(2, self._spec.max_k + 2)) if self._spec is not None else []

    def _verify_plan(self, plan: StepPlan) -> list[TokenEvent]:
        """One verification pass over every slot (worker/engines/speculation/verify_pass.py), read back at once."""
        assert self._verification is not None
        self._table.fit(waiting=bool(self._admission.waiting), ahead=plan.width - 1)
        self._counters.decode_steps += 1
        return self._verification.run(plan, self._table, self._sampling, self._version, self._emit, self._end)

    def _keep_cache(self, seq: DecodingSequence) -> None:
        """Offer a finished sequence's cache (its prompt and the output fed back so far) to the
        prefix cache."""
        buffers = self._table.buffers
        if not self._prefix.enabled or buffers is None or seq.version != self._version or seq.adapter:
            return  # (a sequence made before a swap holds keys and values of older weights)
        held = seq.position  # the step in flight has fed its last token too
        tokens = (seq.prompt + seq.generated)[:held]
        if len(tokens) == held > len(seq.prompt):
            self._prefix.store(tokens, buffers.extract(seq.slot, held), speculative=True)

    def _end(self, seq: DecodingSequence) -> None:
        if seq.adapter is not None and not seq.done:
            self._lora.unpin(seq.adapter)
        seq.done = True
        if self._spec is not None:
            self._spec.ended(seq)
        if seq.constraint is not None:
            seq.constraint.release()
        self._by_uid.pop(seq.spec.uid, None)
        self._table.vacate(seq)
