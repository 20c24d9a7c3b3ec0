"""BatchScheduler: the seam between the RQ worker (jobs) and an engine (sequences).

It admits requests (validation that needs the model: served name, prompt length, vocabulary),
turns each choice into a sequence, feeds engine steps back into per-choice state (text, stop
strings, logprobs), and hands back finished GenerationResults. It knows nothing of Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from schemas import Choice, ErrorInfo, GenerationRequest, GenerationResult, Timings, TopLogprob, Usage
from schemas.request import InvalidRequestError, RequestLimits
from worker.detokenize import IncrementalDetokenizer
from worker.engines.base import Engine, SamplingParams, SequenceSpec, TokenEvent


@dataclass
class ChoiceState:
    index: int
    uid: str
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    finish_reason: Optional[str] = None
    # Characters of detokenizer.text that are final (a stop string may still start after them).
    text_end: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ActiveJob:
    job_id: str
    request: GenerationRequest
    prompt_token_ids: list[int]
    choices: list[ChoiceState]
    enqueued_at: Optional[float]
    started_at: float
    first_token_at: Optional[float] = None

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)


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
    ) -> None:
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.default_max_tokens = default_max_tokens
        self.limits = limits
        self.served_names = served_names or set()
        self.model_name = model_name
        self.worker_name = worker_name
        self._jobs: dict[str, ActiveJob] = {}
        self._uid_to_job: dict[str, str] = {}

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return sum(1 for job in self._jobs.values() for c in job.choices if not c.done)

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - self.num_sequences)

    @property
    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    # --- admission ------------------------------------------------------------------------
    def admit(self, job_id: str, payload: object, *, enqueued_at: Optional[float] = None) -> Optional[GenerationResult]:
        """Start a job. Returns a failed result at once if the request is invalid."""
        started_at = time.time()
        try:
            request = GenerationRequest.validate_payload(payload, self.limits)
            self._check_model(request)
            prompt_ids = self.engine.prompt_token_ids(request)
            self._check_prompt(prompt_ids)
        except (InvalidRequestError, ValueError) as exc:
            return self.failed_result(
                job_id, payload, "InvalidRequest", str(exc), enqueued_at=enqueued_at, started_at=started_at
            )
        max_tokens = request.max_tokens or self.default_max_tokens
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
                    detokenizer=IncrementalDetokenizer(self.engine.decode),
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
                )
            )
            self._uid_to_job[uid] = job_id
        self._jobs[job_id] = ActiveJob(job_id, request, prompt_ids, choices, enqueued_at, started_at)
        self.engine.add(specs)
        return None

    def _check_model(self, request: GenerationRequest) -> None:
        if request.model and self.served_names and request.model not in self.served_names:
            raise InvalidRequestError(
                f"model: this worker serves {sorted(self.served_names)}, not {request.model!r}", field="model"
            )

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

    # --- stepping -------------------------------------------------------------------------
    def step(self) -> list[GenerationResult]:
        """Run one engine step; return the results of jobs that ended in it."""
        events = self.engine.step()
        now = time.time()
        touched: set[str] = set()
        for event in events:
            job_id = self._uid_to_job.get(event.uid)
            if job_id is None:
                continue
            job = self._jobs[job_id]
            if job.first_token_at is None:
                job.first_token_at = now
            self._apply(job, job.choices[int(event.uid.rsplit("#", 1)[1])], event)
            touched.add(job_id)
        return [self._finish(job_id) for job_id in touched if self._jobs[job_id].done]

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
        new_text = "" if is_stop_token else choice.detokenizer.add(event.token)
        stop_at = _find_stop(choice.detokenizer.text, len(new_text), job.request.stop_strings)
        if stop_at is not None:
            choice.text_end = stop_at
            choice.finish_reason = "stop"
            self.engine.remove([choice.uid])
        elif event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        if choice.done:
            self._uid_to_job.pop(choice.uid, None)

    def cancel(self, job_id: str, reason: str = "cancelled") -> Optional[GenerationResult]:
        """End a running job now (reason "cancelled" or "timeout"), keeping its partial output."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        live = [c for c in job.choices if not c.done]
        self.engine.remove([c.uid for c in live])
        for choice in live:
            choice.finish_reason = reason
            self._uid_to_job.pop(choice.uid, None)
        status = "cancelled" if reason == "cancelled" else "failed"
        error = None if reason == "cancelled" else ErrorInfo(type="JobTimeoutException", message="job timed out")
        return self._finish(job_id, status=status, error=error)

    def abort_all(self, error_type: str, message: str) -> list[GenerationResult]:
        """Fail every running job (engine failure); partial outputs are kept."""
        results = []
        for job_id in list(self._jobs):
            job = self._jobs[job_id]
            live = [c for c in job.choices if not c.done]
            try:
                self.engine.remove([c.uid for c in live])
            except Exception:  # the engine is already broken; the results matter more
                pass
            for choice in live:
                choice.finish_reason = "error"
                self._uid_to_job.pop(choice.uid, None)
            results.append(self._finish(job_id, status="failed", error=ErrorInfo(type=error_type, message=message)))
        return results

    # --- results --------------------------------------------------------------------------
    def _finish(self, job_id: str, status: str = "finished", error: Optional[ErrorInfo] = None) -> GenerationResult:
        job = self._jobs.pop(job_id)
        finished_at = time.time()
        choices = []
        for c in job.choices:
            if c.text_end is None:
                c.detokenizer.flush()
            text = c.detokenizer.text if c.text_end is None else c.detokenizer.text[: c.text_end]
            choices.append(
                Choice(
                    index=c.index,
                    text=text,
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    top_logprobs=c.top_logprobs,
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                )
            )
        completion = sum(len(c.token_ids) for c in job.choices)
        request = job.request
        return GenerationResult(
            id=job_id,
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
        payload: object,
        error_type: str,
        message: str,
        *,
        enqueued_at: Optional[float] = None,
        started_at: Optional[float] = None,
    ) -> GenerationResult:
        """A failed result for a job that never ran; echoes what it can of a raw payload."""
        raw = payload if isinstance(payload, dict) else {}
        custom_id = raw.get("custom_id") if isinstance(raw.get("custom_id"), str) else None
        model = raw.get("model") if isinstance(raw.get("model"), str) else self.model_name
        return GenerationResult(
            id=job_id,
            custom_id=custom_id,
            model=model,
            status="failed",
            worker=self.worker_name,
            timings=_timings(enqueued_at, started_at, None, time.time()),
            error=ErrorInfo(type=error_type, message=message),
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
