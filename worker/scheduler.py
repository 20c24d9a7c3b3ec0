"""BatchScheduler: who runs. The seam between the worker's loop (jobs) and an engine (sequences).

It admits requests (validation that needs the model: served name, prompt length, vocabulary,
context, KV-cache budget), turns each choice into a sequence, moves waiting jobs into the engine as
memory allows, steps the engine, and hands the token events to each job's output (worker/output.py),
which builds what the user gets. It returns the jobs that ended; it knows nothing of Redis.
Jobs that fit the limits but not the memory free right now wait here, in order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from schemas import ErrorInfo, GenerationRequest, GenerationResult
from schemas.request import InvalidRequestError, RequestLimits, check_result_entries
from schemas.result import no_output_result
from worker.engines.base import Engine, EngineStats, Prompt, ReadsImages, SamplingParams, SequenceSpec, WatchesQueue
from worker.images import io_image_inputs
from worker.input_prep import SlowInputs
from worker.output import EndedJob, JobOutput, StreamDelta

MIB = 1024 * 1024
TIMEOUT_ERROR = ErrorInfo(type="JobTimeoutException", message="job timed out")

__all__ = ["BatchScheduler", "EndedJob", "SchedulerStats", "StreamDelta"]


@dataclass
class ActiveJob:
    """A job the scheduler holds: what it runs as (its sequences) and what it has produced so far."""

    job_id: str
    request: GenerationRequest
    specs: list[SequenceSpec]
    output: JobOutput
    kv_tokens: int  # tokens of KV cache one choice may need: prompt + max_tokens
    extra_bytes: int = 0  # memory beyond the KV cache while it prefills (Prompt.extra_bytes)
    solo: bool = False
    in_engine: bool = False

    @property
    def live(self) -> int:
        return self.output.live


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler holds now, and its engine's counters."""

    jobs: int  # admitted and not ended
    waiting: int  # of those, not in the engine yet (memory, a solo job)
    sequences: int  # sequences decoding or about to
    kv_reserved_bytes: int  # the KV cache admission counts the running jobs as needing
    kv_budget_bytes: int  # what admission may commit (0: no budget)
    engine: EngineStats


class BatchScheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_num_seqs: int = 32,
        default_max_tokens: int = 256,
        limits: RequestLimits = RequestLimits(),
        served_names: Optional[set[str]] = None,
        model_name: Optional[str] = None,
        worker_name: Optional[str] = None,
        kv_budget_bytes: Optional[int] = None,
    ) -> None:
        self.engine = engine
        # Asked once, not at every poll: a runtime protocol check costs microseconds on the loop's hot path.
        self._queue_watcher = engine if isinstance(engine, WatchesQueue) else None
        self.max_num_seqs = max_num_seqs
        self.default_max_tokens = default_max_tokens
        self.limits = limits
        self.served_names = served_names or set()
        self.model_name = model_name
        self.worker_name = worker_name
        self.kv_budget_bytes = kv_budget_bytes
        self._jobs: dict[str, ActiveJob] = {}
        self._waiting: deque[str] = deque()  # admitted, not yet in the engine (memory, solo)
        self._uid_to_job: dict[str, str] = {}
        self._streams: list[StreamDelta] = []
        self._live_sequences = 0
        self.last_step_tokens = 0  # tokens the last step made

    def stats(self) -> SchedulerStats:
        running = [job for job in self._jobs.values() if job.in_engine]
        longest = max((job.kv_tokens for job in running), default=0)
        reserved = sum(job.live for job in running) * longest * self.engine.kv_bytes_per_token
        return SchedulerStats(jobs=len(self._jobs), waiting=len(self._waiting), sequences=self._live_sequences,
                              kv_reserved_bytes=reserved, kv_budget_bytes=self.kv_budget_bytes or 0,
                              engine=self.engine.stats())

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return self._live_sequences

    @property
    def free_slots(self) -> int:
        if any(job.solo for job in self._jobs.values()):
            return 0  # a job under suspicion runs alone
        return max(0, self.max_num_seqs - self.num_sequences)

    @property
    def decoding(self) -> bool:
        """Whether a running job has produced tokens: its sequences wait on every step."""
        return any(job.output.first_token_at is not None for job in self._jobs.values())

    @property
    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    # --- admission ------------------------------------------------------------------------
    def slow_prepare(self, payload: object) -> Optional[SlowInputs]:
        """For a request whose input takes long to prepare (images to read, decode and process, a
        constraint to compile), that work, to run off the loop's thread (worker/input_prep.py) before
        `admit(..., prepared=)`; None for the others. Validation is part of that work; the images read from files or fetched
        are found in the raw request (no more than MLXQ_MAX_IMAGES of them: more fail validation). A
        constraint's checks and compile take up to tens of milliseconds where it is new (both are kept
        per text: `admit` then finds them done), so even its validation is not the loop's."""
        if not _has_images(payload) and not _has_constraint(payload):
            return None
        engine, limits = self.engine, self.limits

        def validated() -> GenerationRequest:
            return GenerationRequest.validate_payload(payload, limits)

        reads = io_image_inputs(payload, limits.max_images) if isinstance(engine, ReadsImages) else []
        if not reads:
            return SlowInputs([], None, lambda fetched: engine.prepare(validated()))
        assert isinstance(engine, ReadsImages)
        return SlowInputs(reads, engine.read_image, lambda fetched: engine.prepare(validated(), fetched))

    def admit(
        self, job_id: str, payload: object, *, enqueued_at: Optional[float] = None, solo: bool = False,
        prepared: Optional[Prompt] = None,
    ) -> Optional[GenerationResult]:
        """Take a job. Returns a failed result at once if it can never run here; otherwise it
        enters the engine at the next step, or as soon as memory allows after that (`solo`: only
        into an empty batch). Jobs admitted between two steps enter together. `prepared`: the
        engine's Prompt for it, made already (`slow_prepare`)."""
        started_at = time.time()
        try:
            request = GenerationRequest.validate_payload(payload, self.limits)
            self._check_model(request)
            self._check_adapter(request)
            prompt = prepared if prepared is not None else self.engine.prepare(request)
            prompt_ids = prompt.token_ids
            self._check_prompt(prompt_ids)
            self._check_agent_fields(request, prompt)
            max_tokens = request.max_tokens if request.max_tokens is not None else self.default_max_tokens
            check_result_entries(request, max_tokens, self.limits)
            self._check_against_model(request, len(prompt_ids), max_tokens)
            self._check_capacity(request, len(prompt_ids) + max_tokens, prompt.extra_bytes)
        except (InvalidRequestError, ValueError) as exc:
            return self.failed_result(
                job_id, payload, "InvalidRequest", str(exc), enqueued_at=enqueued_at, started_at=started_at
            )
        job = self._build_job(job_id, request, prompt, max_tokens, enqueued_at, started_at, solo)
        self._jobs[job_id] = job
        self._live_sequences += job.live
        self._waiting.append(job_id)
        return None

    def _build_job(
        self,
        job_id: str,
        request: GenerationRequest,
        prompt: Prompt,
        max_tokens: int,
        enqueued_at: Optional[float],
        started_at: float,
        solo: bool,
    ) -> ActiveJob:
        prompt_ids = prompt.token_ids
        stop_ids = frozenset(request.stop_token_ids or ()) | (
            frozenset() if request.ignore_eos else self.engine.eos_token_ids
        )
        output = JobOutput(job_id, request, prompt_ids, stop_ids, decode=self.engine.decode,
                           token_text=self.engine.token_text, model=self.model_name, worker=self.worker_name,
                           enqueued_at=enqueued_at, started_at=started_at, reply=prompt.reply)
        sampling = SamplingParams.from_request(request)
        specs = [
            SequenceSpec(
                uid=choice.uid,
                prompt_token_ids=prompt_ids,
                max_tokens=max_tokens,
                sampling=sampling,
                stop_token_ids=stop_ids,
                logprobs=request.wants_logprobs,
                top_logprobs=request.top_logprobs,
                logprobs_mode=request.logprobs_mode,
                choice_index=choice.index,
                request_id=job_id,
                inputs=prompt.inputs,
                adapter=request.adapter,
                prompt_logprobs=request.prompt_logprobs,
                speculative=request.speculative,
            )
            for choice in output.choices
        ]
        return ActiveJob(job_id, request, specs, output, kv_tokens=len(prompt_ids) + max_tokens,
                         extra_bytes=prompt.extra_bytes, solo=solo)

    def _admit_waiting(self) -> None:
        """Move waiting jobs into the engine, in arrival order, while they fit. They enter in one
        `engine.add`, so sequences admitted together with the same prompt share its prefill."""
        if not self._waiting:
            return
        running = [j for j in self._jobs.values() if j.in_engine]
        live = sum(j.live for j in running)
        longest = max((j.kv_tokens for j in running), default=0)
        extra = 0  # the entering jobs' memory beyond their KV caches: they prefill together
        solo_running = any(j.solo for j in running)
        # An engine that runs one adapter at a time takes the next adapter's jobs once the batch is empty.
        grouped = self.engine.adapter_batching == "grouped"
        entering: list[SequenceSpec] = []
        while self._waiting:
            job = self._jobs.get(self._waiting[0])
            if job is None:  # cancelled while waiting
                self._waiting.popleft()
                continue
            if running and (job.solo or solo_running or not self._fits(live, longest, extra, job)):
                break
            if grouped and running and job.request.adapter != running[0].request.adapter:
                break
            self._waiting.popleft()
            job.in_engine = True
            for spec in job.specs:
                self._uid_to_job[spec.uid] = job.job_id
            entering.extend(job.specs)
            running.append(job)
            live += job.live
            longest = max(longest, job.kv_tokens)
            extra += job.extra_bytes
            solo_running = solo_running or job.solo
        if entering:
            self.engine.add(entering)

    def _fits(self, live: int, longest: int, extra: int, job: ActiveJob) -> bool:
        """Whether `job` fits beside running jobs holding `live` sequences, the longest of which
        may need `longest` tokens of KV cache, and jobs entering with it that need `extra` bytes
        beyond their caches."""
        if live + len(job.specs) > self.max_num_seqs:
            return False
        if not self.kv_budget_bytes or not self.engine.kv_bytes_per_token:
            return True
        # The batched KV cache is padded to its longest row: rows x longest is what it may take.
        need = (live + len(job.specs)) * max(longest, job.kv_tokens) * self.engine.kv_bytes_per_token
        return need + extra + job.extra_bytes <= self.kv_budget_bytes

    def _check_model(self, request: GenerationRequest) -> None:
        if request.model and self.served_names and request.model not in self.served_names:
            raise InvalidRequestError(f"model: this worker serves {self.model_name!r}, not {request.model!r}",
                                      field="model")

    def _check_adapter(self, request: GenerationRequest) -> None:
        """An engine without `adapter_batching` serves no adapters: such a request fails, never runs on the base model."""
        if request.adapter is not None and self.engine.adapter_batching is None:
            raise InvalidRequestError(f"adapter: {request.adapter!r} cannot run here: {self.engine.adapter_refusal}",
                                      field="adapter")

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt: tokenizes to zero tokens", field="prompt")
        if len(prompt_ids) > self.limits.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt: {len(prompt_ids)} tokens exceeds the limit of {self.limits.max_prompt_tokens}",
                field="prompt",
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids: {len(bad)} ids outside the vocabulary [0, {self.engine.vocab_size}), "
                f"e.g. {bad[0]}",
                field="prompt_token_ids",
            )

    def _check_agent_fields(self, request: GenerationRequest, prompt: Prompt) -> None:
        """Tools and prompt log-probabilities need an engine that serves them (the text engines do)."""
        if request.parses_tool_calls and (prompt.reply is None or prompt.reply.tools is None):
            raise InvalidRequestError("tools: this worker's engine does not serve tool calls", field="tools")
        if request.prompt_logprobs is not None and not getattr(self.engine, "serves_prompt_logprobs", False):
            raise InvalidRequestError("prompt_logprobs: this worker's engine does not score prompts",
                                      field="prompt_logprobs")

    def _check_against_model(self, request: GenerationRequest, prompt_tokens: int, max_tokens: int) -> None:
        """Everything else a request names that only the served model can check: token ids inside its
        vocabulary, top-k below it, prompt and output inside its context."""
        vocab = self.engine.vocab_size
        named = (("logit_bias", sorted(request.logit_bias or ())), ("stop_token_ids", request.stop_token_ids or ()))
        for field_name, token_ids in named:
            outside = [t for t in token_ids if t >= vocab]
            if outside:
                raise InvalidRequestError(
                    f"{field_name}: token id {outside[0]} is outside this model's vocabulary [0, {vocab})",
                    field=field_name)
        if request.top_k >= vocab:
            raise InvalidRequestError(
                f"top_k: {request.top_k} must be below this model's vocabulary size {vocab} (0 turns top-k off)",
                field="top_k")
        context = self.engine.context_length
        if context and prompt_tokens + max_tokens > context:
            raise InvalidRequestError(
                f"max_tokens: the prompt's {prompt_tokens} tokens + max_tokens {max_tokens} exceed this model's "
                f"context of {context} tokens", field="max_tokens")

    def _check_capacity(self, request: GenerationRequest, kv_tokens: int, extra_bytes: int) -> None:
        if request.n > self.max_num_seqs:
            raise InvalidRequestError(
                f"n: {request.n} choices exceed this worker's MLXQ_MAX_NUM_SEQS of {self.max_num_seqs}", field="n"
            )
        per_token = self.engine.kv_bytes_per_token
        if not self.kv_budget_bytes or not per_token:
            return
        need = request.n * kv_tokens * per_token + extra_bytes
        if need > self.kv_budget_bytes:
            raise InvalidRequestError(
                f"max_tokens: prompt + max_tokens = {kv_tokens} tokens x n={request.n} needs "
                f"{need / MIB:.0f} MiB of KV cache, more than this worker's budget of "
                f"{self.kv_budget_bytes / MIB:.0f} MiB (MLXQ_KV_BUDGET_MB)",
                field="max_tokens",
            )

    # --- stepping -------------------------------------------------------------------------
    def queue_seen(self, jobs_waiting: bool) -> None:
        """The worker's latest poll found jobs left in its queues (`jobs_waiting`), or none."""
        if self._queue_watcher is not None:
            self._queue_watcher.queue_seen(jobs_waiting)

    def step(self) -> list[EndedJob]:
        """Run one engine step; return the jobs that ended in it. An exception from the engine
        means the step as a whole failed: see `reset`."""
        self._admit_waiting()
        events = self.engine.step()
        self.last_step_tokens = len(events)
        now = time.time()
        ended: list[EndedJob] = []
        touched: dict[str, ActiveJob] = {}
        for event in events:
            job_id = self._uid_to_job.get(event.uid)
            job = self._jobs.get(job_id) if job_id else None
            if job is None:
                continue
            try:
                if event.error is not None:
                    raise RuntimeError(event.error)
                choice = job.output.apply(event, now)
                if choice is not None:
                    self._choice_ended(choice.uid)
                    if event.finish_reason is None:  # a stop string ended it: the engine would go on
                        self.engine.remove([choice.uid])
                touched[job.job_id] = job
            except Exception as exc:  # this sequence's fault: fail its job only
                touched.pop(job.job_id, None)
                ended.append(self._end_now(job.job_id, "error", "failed",
                                           ErrorInfo(type="SequenceError", message=f"{type(exc).__name__}: {exc}")))
        for job in touched.values():
            self._streams.extend(job.output.stream_deltas())
            if job.live == 0:
                ended.append(self._finish(job.job_id))
        if ended:
            self._admit_waiting()
        return ended

    def _choice_ended(self, uid: str) -> None:
        self._uid_to_job.pop(uid, None)
        self._live_sequences -= 1

    def take_stream_deltas(self) -> list[StreamDelta]:
        deltas, self._streams = self._streams, []
        return deltas

    def cancel(self, job_id: str, reason: str = "cancelled") -> Optional[EndedJob]:
        """End a running job now (reason "cancelled" or "timeout"), keeping its partial output."""
        if job_id not in self._jobs:
            return None
        if reason == "cancelled":
            return self._end_now(job_id, "cancelled", "cancelled")
        return self._end_now(job_id, "timeout", "failed", TIMEOUT_ERROR)

    def abort_all(self, error_type: str, message: str) -> list[EndedJob]:
        """Fail every job (a shutdown); partial outputs are kept."""
        return [self._end_now(job_id, "error", "failed", ErrorInfo(type=error_type, message=message))
                for job_id in list(self._jobs)]

    def withdraw(self, job_ids: Optional[list[str]] = None) -> list[str]:
        """Take jobs (all, or these) out without ending them, to run again later or elsewhere: their
        sequences leave the engine and what they produced so far is dropped. Returns their ids."""
        chosen = list(self._jobs) if job_ids is None else [j for j in job_ids if j in self._jobs]
        for job_id in chosen:
            job = self._jobs.pop(job_id)
            live = [c.uid for c in job.output.choices if not c.done]
            if job.in_engine:
                self.engine.remove(live)
            for uid in live:
                self._uid_to_job.pop(uid, None)
            self._live_sequences -= job.live
        self._streams = [d for d in self._streams if d.job_id in self._jobs]
        return chosen

    def reset(self, restart_engine: bool = True) -> list[str]:
        """After a failed engine step: forget the jobs that were in the engine (their state may
        be corrupt), give the engine a fresh batch (unless its device is gone), and return their ids so
        the caller can retry or fail them. Jobs still waiting to enter were not involved and keep waiting."""
        suspects = [job_id for job_id, job in self._jobs.items() if job.in_engine]
        for job_id in suspects:
            self._live_sequences -= self._jobs.pop(job_id).live
        self._uid_to_job.clear()
        self._streams = [d for d in self._streams if d.job_id in self._jobs]
        if restart_engine:
            self.engine.reset()
        return suspects

    def _end_now(self, job_id: str, finish_reason: str, status: str, error: Optional[ErrorInfo] = None
                 ) -> EndedJob:
        job = self._jobs[job_id]
        live = job.output.end_live(finish_reason)
        if job.in_engine:
            self.engine.remove([c.uid for c in live])
        for choice in live:
            self._choice_ended(choice.uid)
        self._streams.extend(job.output.stream_deltas())
        return self._finish(job_id, status=status, error=error)

    def _finish(self, job_id: str, status: str = "finished", error: Optional[ErrorInfo] = None) -> EndedJob:
        return self._jobs.pop(job_id).output.ended(status, error)

    def failed_result(
        self,
        job_id: str,
        payload: Any,
        error_type: str,
        message: str,
        *,
        enqueued_at: Optional[float] = None,
        started_at: Optional[float] = None,
        status: str = "failed",
    ) -> GenerationResult:
        """The result of a job that never ran; echoes what it can of a raw payload."""
        return no_output_result(job_id, status, error_type=error_type, message=message,  # type: ignore[arg-type]
                                request=payload, model=self.model_name, worker=self.worker_name,
                                enqueued_at=enqueued_at, started_at=started_at)


def _has_constraint(payload: object) -> bool:
    return isinstance(payload, dict) and any(payload.get(name) is not None
                                             for name in ("response_format", "guided_regex", "guided_grammar"))


def _has_images(payload: object) -> bool:
    messages = payload.get("messages") if isinstance(payload, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") == "image_url" for part in m["content"])
        for m in messages)
