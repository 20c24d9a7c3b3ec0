"""BatchScheduler: the seam between the RQ worker (jobs) and an engine (sequences).

It admits requests (validation that needs the model: served name, prompt length, vocabulary,
KV-cache budget), turns each choice into a sequence, feeds engine steps back into per-choice
state (text, stop strings, logprobs, stream deltas), and hands back the jobs that ended, whose
GenerationResults are built on demand (`EndedJob.result`).
Jobs that fit the limits but not the memory free right now wait here, in order. It knows
nothing of Redis.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from schemas import Choice, ErrorInfo, GenerationRequest, GenerationResult, Timings, TopLogprob, Usage
from schemas.request import InvalidRequestError, RequestLimits
from schemas.result import request_echo
from schemas.serializer import EncodedJSON
from worker.detokenize import IncrementalDetokenizer
from worker.engines.base import Engine, Prompt, SamplingParams, SequenceSpec, TokenEvent

MIB = 1024 * 1024


@dataclass
class ChoiceState:
    index: int
    uid: str
    # Text as tokens arrive, only for requests that need it (stop strings, streaming); the others
    # decode once at the end, which spares every decode step a detokenizer call per sequence.
    detokenizer: Optional[IncrementalDetokenizer]
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    finish_reason: Optional[str] = None
    # Where `text` ends when a stop string cut it; None = the whole decoded text.
    text_end: Optional[int] = None
    # Stream bookkeeping: tokens and characters already handed out as deltas.
    streamed_tokens: int = 0
    streamed_chars: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text so far, for choices decoded token by token (the others decode when the result is built)."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text if self.text_end is None else self.detokenizer.text[: self.text_end]


@dataclass
class ActiveJob:
    job_id: str
    request: GenerationRequest
    prompt_token_ids: list[int]
    choices: list[ChoiceState]
    specs: list[SequenceSpec]
    enqueued_at: Optional[float]
    started_at: float
    kv_tokens: int  # tokens of KV cache one choice may need: prompt + max_tokens
    extra_bytes: int = 0  # memory beyond the KV cache while it prefills (Prompt.extra_bytes)
    solo: bool = False
    first_token_at: Optional[float] = None
    in_engine: bool = False
    live: int = 0  # choices not yet ended

    @property
    def done(self) -> bool:
        return self.live == 0


@dataclass
class EndedJob:
    """A job that ended. `result()` builds its GenerationResult, once, on whichever thread calls
    it: nothing of an ended job changes any more, so the worker builds results on its bookkeeping
    thread rather than in the step. (Measured on the 2-core CPU: 256 results of 128 tokens took
    ~5 ms of pydantic and ~25 ms of detokenizing, all in the step that ended them.)"""

    id: str
    status: str
    build: Callable[[], GenerationResult] = field(repr=False)
    _result: Optional[GenerationResult] = field(default=None, repr=False)
    _encoded: Optional[EncodedJSON] = field(default=None, repr=False)

    @classmethod
    def built(cls, result: GenerationResult) -> "EndedJob":
        return cls(result.id, result.status, lambda: result, result)

    def result(self) -> GenerationResult:
        """Never raises: a result that cannot be built is a failed one, so the job still ends."""
        if self._result is None:
            try:
                self._result = self.build()
            except Exception as exc:
                self._result = GenerationResult(
                    id=self.id, status="failed",
                    error=ErrorInfo(type="ResultError", message=f"could not build the result: {exc!r}"))
        return self._result

    def encoded(self) -> EncodedJSON:
        """The result as JSON, encoded once: its result key and rq's return value are this text."""
        if self._encoded is None:
            self._encoded = EncodedJSON(self.result().model_dump_json())
        return self._encoded


@dataclass
class StreamDelta:
    """What one choice of a streaming job produced since the last delta."""

    job_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None


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
        return any(job.first_token_at is not None for job in self._jobs.values())

    @property
    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    # --- admission ------------------------------------------------------------------------
    def admit(
        self, job_id: str, payload: object, *, enqueued_at: Optional[float] = None, solo: bool = False
    ) -> Optional[GenerationResult]:
        """Take a job. Returns a failed result at once if it can never run here; otherwise it
        enters the engine at the next step, or as soon as memory allows after that (`solo`: only
        into an empty batch). Jobs admitted between two steps enter together."""
        started_at = time.time()
        try:
            request = GenerationRequest.validate_payload(payload, self.limits)
            self._check_model(request)
            prompt = self.engine.prepare(request)
            prompt_ids = prompt.token_ids
            self._check_prompt(prompt_ids)
            max_tokens = request.max_tokens or self.default_max_tokens
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
        sampling = SamplingParams.from_request(request)
        choices, specs = [], []
        for index in range(request.n):
            uid = f"{job_id}#{index}"
            choices.append(
                ChoiceState(
                    index=index,
                    uid=uid,
                    detokenizer=(IncrementalDetokenizer(self.engine.decode)
                                 if request.stop or request.stream else None),
                    stop_ids=stop_ids,
                    logprobs=[] if request.wants_logprobs else None,
                    top_logprobs=[] if request.top_logprobs else None,
                )
            )
            specs.append(
                SequenceSpec(
                    uid=uid,
                    prompt_token_ids=prompt_ids,
                    max_tokens=max_tokens,
                    sampling=sampling,
                    stop_token_ids=stop_ids,
                    logprobs=request.wants_logprobs,
                    top_logprobs=request.top_logprobs,
                    logprobs_mode=request.logprobs_mode,
                    choice_index=index,
                    request_id=job_id,
                    inputs=prompt.inputs,
                )
            )
        return ActiveJob(job_id, request, prompt_ids, choices, specs, enqueued_at, started_at,
                         kv_tokens=len(prompt_ids) + max_tokens, extra_bytes=prompt.extra_bytes, solo=solo,
                         live=len(choices))

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
        entering: list[SequenceSpec] = []
        while self._waiting:
            job = self._jobs.get(self._waiting[0])
            if job is None:  # cancelled while waiting
                self._waiting.popleft()
                continue
            if running and (job.solo or solo_running or not self._fits(live, longest, extra, job)):
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
        if live + len(job.choices) > self.max_num_seqs:
            return False
        if not self.kv_budget_bytes or not self.engine.kv_bytes_per_token:
            return True
        # The batched KV cache is padded to its longest row: rows x longest is what it may take.
        need = (live + len(job.choices)) * max(longest, job.kv_tokens) * self.engine.kv_bytes_per_token
        return need + extra + job.extra_bytes <= self.kv_budget_bytes

    def _check_model(self, request: GenerationRequest) -> None:
        if request.model and self.served_names and request.model not in self.served_names:
            raise InvalidRequestError(f"model: this worker serves {self.model_name!r}, not {request.model!r}",
                                      field="model")

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
    def step(self) -> list[EndedJob]:
        """Run one engine step; return the jobs that ended in it. An exception from the engine
        means the step as a whole failed: see `reset`."""
        self._admit_waiting()
        events = self.engine.step()
        now = time.time()
        ended: list[EndedJob] = []
        touched: dict[str, ActiveJob] = {}
        for event in events:
            job_id = self._uid_to_job.get(event.uid)
            job = self._jobs.get(job_id) if job_id else None
            if job is None:
                continue
            if job.first_token_at is None:
                job.first_token_at = now
            try:
                if event.error is not None:
                    raise RuntimeError(event.error)
                self._apply(job, job.choices[event.index], event)
                touched[job.job_id] = job
            except Exception as exc:  # this sequence's fault: fail its job only
                touched.pop(job.job_id, None)
                ended.append(self._end_now(job.job_id, "error", "failed",
                                           ErrorInfo(type="SequenceError", message=f"{type(exc).__name__}: {exc}")))
        for job in touched.values():
            if job.request.stream:
                self._collect_stream(job)
            if job.live == 0:
                ended.append(self._finish(job.job_id))
        if ended:
            self._admit_waiting()
        return ended

    def _apply(self, job: ActiveJob, choice: ChoiceState, event: TokenEvent) -> None:
        if choice.done:
            return
        choice.token_ids.append(event.token)
        if choice.logprobs is not None and event.logprob is not None:
            choice.logprobs.append(event.logprob)
        if choice.top_logprobs is not None and event.top_logprobs is not None:
            choice.top_logprobs.append(
                [TopLogprob(token_id=t, token=self.engine.token_text(t), logprob=lp) for t, lp in event.top_logprobs]
            )
        is_stop_token = event.finish_reason == "stop" and event.token in choice.stop_ids
        stop_at = None
        if choice.detokenizer is not None:
            new_text = "" if is_stop_token else choice.detokenizer.add(event.token)
            stop_at = _find_stop(choice.detokenizer.text, len(new_text), job.request.stop_strings)
        if stop_at is not None:
            choice.text_end = stop_at
            choice.finish_reason = "stop"
            self.engine.remove([choice.uid])
        elif event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        if choice.done:
            self._choice_ended(job, choice)

    def _choice_ended(self, job: ActiveJob, choice: ChoiceState) -> None:
        self._uid_to_job.pop(choice.uid, None)
        self._settle_text(choice)
        job.live -= 1
        self._live_sequences -= 1

    def _settle_text(self, choice: ChoiceState) -> None:
        """A choice just ended: a detokenizer's held-back text is final."""
        if choice.detokenizer is not None and choice.text_end is None:
            choice.detokenizer.flush()

    def _final_text(self, choice: ChoiceState) -> str:
        """An ended choice's text (EOS and stop tokens are not text)."""
        if choice.detokenizer is not None:
            return choice.text
        tokens = choice.token_ids
        if choice.finish_reason == "stop" and tokens and tokens[-1] in choice.stop_ids:
            tokens = tokens[:-1]
        return self.engine.decode(tokens)

    def _collect_stream(self, job: ActiveJob) -> None:
        if not job.request.stream:
            return
        holdback = max((len(s) for s in job.request.stop_strings), default=1) - 1
        for choice in job.choices:
            text = choice.text
            # Hold back what could be the start of a stop string until it is decided.
            end = len(text) if choice.done else max(choice.streamed_chars, len(text) - holdback)
            if choice.streamed_tokens == len(choice.token_ids) and end == choice.streamed_chars:
                continue
            self._streams.append(StreamDelta(job.job_id, choice.index, choice.token_ids[choice.streamed_tokens :],
                                             text[choice.streamed_chars : end], choice.finish_reason))
            choice.streamed_tokens, choice.streamed_chars = len(choice.token_ids), end

    def take_stream_deltas(self) -> list[StreamDelta]:
        deltas, self._streams = self._streams, []
        return deltas

    def cancel(self, job_id: str, reason: str = "cancelled") -> Optional[EndedJob]:
        """End a running job now (reason "cancelled" or "timeout"), keeping its partial output."""
        if job_id not in self._jobs:
            return None
        if reason == "cancelled":
            return self._end_now(job_id, "cancelled", "cancelled")
        return self._end_now(job_id, "timeout", "failed", ErrorInfo(type="JobTimeoutException", message="job timed out"))

    def abort_all(self, error_type: str, message: str) -> list[EndedJob]:
        """Fail every job (a shutdown); partial outputs are kept."""
        return [self._end_now(job_id, "error", "failed", ErrorInfo(type=error_type, message=message))
                for job_id in list(self._jobs)]

    def reset(self) -> list[str]:
        """After a failed engine step: forget the jobs that were in the engine (their state may
        be corrupt), give the engine a fresh batch, and return their ids so the caller can retry
        or fail them. Jobs still waiting to enter were not involved and keep waiting."""
        suspects = [job_id for job_id, job in self._jobs.items() if job.in_engine]
        for job_id in suspects:
            self._live_sequences -= self._jobs.pop(job_id).live
        self._uid_to_job.clear()
        self._streams = [d for d in self._streams if d.job_id in self._jobs]
        self.engine.reset()
        return suspects

    def _end_now(self, job_id: str, finish_reason: str, status: str, error: Optional[ErrorInfo] = None
                 ) -> EndedJob:
        job = self._jobs[job_id]
        live = [c for c in job.choices if not c.done]
        if job.in_engine:
            self.engine.remove([c.uid for c in live])
        for choice in live:
            choice.finish_reason = finish_reason
            self._choice_ended(job, choice)
        self._collect_stream(job)
        return self._finish(job_id, status=status, error=error)

    # --- results --------------------------------------------------------------------------
    def _finish(self, job_id: str, status: str = "finished", error: Optional[ErrorInfo] = None) -> EndedJob:
        job = self._jobs.pop(job_id)
        finished_at = time.time()
        return EndedJob(job_id, status, lambda: self._result(job, status, error, finished_at))

    def _result(self, job: ActiveJob, status: str, error: Optional[ErrorInfo], finished_at: float
                ) -> GenerationResult:
        choices = [
            Choice(index=c.index, text=self._final_text(c), token_ids=c.token_ids, logprobs=c.logprobs,
                   top_logprobs=c.top_logprobs, finish_reason=c.finish_reason)  # type: ignore[arg-type]
            for c in job.choices
        ]
        completion = sum(len(c.token_ids) for c in job.choices)
        request = job.request
        return GenerationResult(
            id=job.job_id,
            custom_id=request.custom_id,
            model=request.model or self.model_name,
            status=status,  # type: ignore[arg-type]
            choices=choices,
            prompt_token_ids=job.prompt_token_ids if request.return_prompt_token_ids else None,
            usage=Usage(
                prompt_tokens=len(job.prompt_token_ids),
                completion_tokens=completion,
                total_tokens=len(job.prompt_token_ids) + completion,
            ),
            timings=_timings(job.enqueued_at, job.started_at, job.first_token_at, finished_at),
            worker=self.worker_name,
            error=error,
            metadata=request.metadata,
        )

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
        echo = request_echo(payload)
        return GenerationResult(
            id=job_id,
            custom_id=echo.get("custom_id"),
            model=echo.get("model", self.model_name),
            status=status,  # type: ignore[arg-type]
            worker=self.worker_name,
            timings=_timings(enqueued_at, started_at, None, time.time()),
            error=None if status == "cancelled" else ErrorInfo(type=error_type, message=message),
        )


def _find_stop(text: str, new_chars: int, stops: list[str]) -> Optional[int]:
    """Where the first stop string starts, looking only where the newest `new_chars` could have
    completed one (a stop string may straddle any number of tokens)."""
    if not stops or not new_chars:
        return None
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    positions = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(positions) if positions else None


def _timings(
    enqueued_at: Optional[float], started_at: Optional[float], first_token_at: Optional[float], finished_at: float
) -> Timings:
    return Timings(
        enqueued_at=enqueued_at,
        started_at=started_at,
        finished_at=finished_at,
        queue_s=(started_at - enqueued_at) if enqueued_at and started_at else None,
        ttft_s=(first_token_at - started_at) if first_token_at and started_at else None,
        generation_s=(finished_at - started_at) if started_at else None,
    )
