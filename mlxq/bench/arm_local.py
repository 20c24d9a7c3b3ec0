"""Arms A and B: mlx-lm in the harness process, no queue and no network.

A runs one request at a time with `mlx_lm.generate.generate_step` (what a stock one-job-at-a-time
worker does per job, minus the queue); B feeds mlx-lm's `BatchGenerator` directly (the engine
bound). Both sample greedily and never stop on EOS, so every request yields exactly max_tokens.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Optional

from mlxq.bench.arms import Arm
from mlxq.bench.workloads import Arrivals, BenchRequest, RequestRecord, Workload
from worker.engines.counters import EngineCounters


class LocalModel:
    """One loaded copy of the model (and its tokenizer), shared by A, B and S and dropped after them.
    `weights="worker"`: in the formats a worker serves on this device (worker/weight_prep.py);
    "as-loaded": as mlx-lm loads it."""

    def __init__(self, path: str, weights: str = "worker") -> None:
        self.path = path
        self.weights = weights
        self.model: Any = None
        self.tokenizer: Any = None
        self.formats: list[str] = []  # what was done to the weights, in words

    def load(self) -> Any:
        if self.model is None:
            import worker  # noqa: F401  (same BLAS as the mlxq worker, before mlx loads)
            from mlx_lm import load

            from worker.weight_prep import prepare_weights

            self.model, self.tokenizer = load(self.path)
            if self.weights == "worker":
                self.formats = prepare_weights(self.model).notes
        return self.model

    def unload(self) -> None:
        if self.model is not None:
            import mlx.core as mx

            self.model = self.tokenizer = None
            gc.collect()
            mx.clear_cache()


def _sleep_until(t0: float, when: Optional[float]) -> None:
    if when is not None:
        time.sleep(max(0.0, min(when - (time.perf_counter() - t0), 0.5)))


class _LocalArm(Arm):
    """An arm that runs in the bench's process on the shared model: a warm-up pass, then the run."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local

    def start(self) -> None:
        self.local.load()

    def run(self, workload: Workload, warmup: Optional[Workload]) -> list[RequestRecord]:
        if warmup is not None:
            self._run(warmup)
        return self._run(workload)

    def _run(self, workload: Workload) -> list[RequestRecord]:
        raise NotImplementedError


class _BatchingArm(_LocalArm):
    def __init__(self, local: LocalModel, max_num_seqs: int, prefill_batch_size: int) -> None:
        super().__init__(local)
        self.max_num_seqs = max_num_seqs
        self.prefill_batch_size = prefill_batch_size


class SequentialArm(_LocalArm):
    key = "A"
    methods = {
        "queue": "arrival to the start of its generation (requests wait their turn in FIFO order)",
        "ttft": "arrival to the first token yielded by mlx_lm.generate.generate_step",
        "e2e": "arrival to its last token",
        "eos": "generate_step has no EOS check (stream_generate would stop there)",
    }

    def _run(self, workload: Workload) -> list[RequestRecord]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        model = self.local.load()
        arrivals = Arrivals(workload)
        waiting: list[tuple[BenchRequest, float]] = []
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        while True:
            waiting.extend(arrivals.due(time.perf_counter() - t0))
            if not waiting:
                if arrivals.exhausted:
                    break
                _sleep_until(t0, arrivals.next_arrival())
                continue
            request, arrival = waiting.pop(0)
            record = RequestRecord(request.index, arrival, started=time.perf_counter() - t0)
            token_ids = record.extra["token_ids"] = []
            # generate_step applies no EOS check (stream_generate would): fixed lengths.
            for token, _logprobs in generate_step(mx.array(list(request.prompt.ids)), model,
                                                  max_tokens=request.max_tokens):
                if record.tokens == 0:
                    record.first_token = time.perf_counter() - t0
                record.tokens += 1
                token_ids.append(int(token))
            record.finished = time.perf_counter() - t0
            records.append(record)
            arrivals.completed(request, record.finished)
        return records


class EngineBoundArm(_BatchingArm):
    key = "B"
    methods = {
        "queue": "arrival to the end of the BatchGenerator step that returned its first prefill progress",
        "ttft": "arrival to the end of the BatchGenerator.next() call that returned its first token",
        "e2e": "arrival to the end of the step that returned its last token",
        "eos": "BatchGenerator built without stop tokens",
    }

    def info(self) -> dict[str, Any]:
        return {"completion_batch_size": self.max_num_seqs, "prefill_batch_size": self.prefill_batch_size}

    def _run(self, workload: Workload) -> list[RequestRecord]:
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(
            self.local.load(),
            completion_batch_size=self.max_num_seqs,
            prefill_batch_size=min(self.prefill_batch_size, self.max_num_seqs),
        )  # no stop_tokens: EOS does not end a sequence
        arrivals = Arrivals(workload)
        live: dict[int, tuple[BenchRequest, RequestRecord]] = {}
        records: list[RequestRecord] = []
        counters = EngineCounters()
        t0 = time.perf_counter()
        try:
            while True:
                due = arrivals.due(time.perf_counter() - t0)
                if due:
                    uids = generator.insert([list(r.prompt.ids) for r, _ in due],
                                            max_tokens=[r.max_tokens for r, _ in due])
                    for uid, (request, arrival) in zip(uids, due):
                        live[uid] = (request, RequestRecord(request.index, arrival, extra={"token_ids": []}))
                if not live:
                    if arrivals.exhausted:
                        break
                    _sleep_until(t0, arrivals.next_arrival())
                    continue
                with generator.stats() as window:
                    prompt_responses, responses = generator.next()
                counters.add_generator_window(window)
                now = time.perf_counter() - t0
                for progress in prompt_responses:
                    entry = live.get(progress.uid)
                    if entry is not None and entry[1].started is None:
                        entry[1].started = now
                for response in responses:
                    request, record = live[response.uid]
                    if record.first_token is None:
                        record.first_token = now
                    record.tokens += 1
                    record.extra["token_ids"].append(int(response.token))
                    if response.finish_reason is not None:
                        record.finished = now
                        records.append(record)
                        del live[response.uid]
                        arrivals.completed(request, now)
        finally:
            generator.close()
        self.time_split = {f"engine_{name}": float(value) for name, value in counters.as_dict().items()}
        return records


class SchedulerArm(_BatchingArm):
    """mlxq's own BatchScheduler and the engine a worker would pick (worker/loading.py) driven in this
    process: what the worker runs, with no Redis, RQ or worker loop around it. Against B it prices
    mlxq's engine wrapper; against C, the queue. It builds each ended job's result in its loop, which a worker leaves to its
    bookkeeping thread (~0.1 ms a result)."""

    key = "S"
    methods = {
        "queue": "none: a request is admitted the moment it arrives",
        "ttft": "arrival to the first token, from the result's timings (started_at + ttft_s)",
        "e2e": "arrival to the end of the scheduler step that ended the job",
        "eos": "requests carry ignore_eos: true",
    }

    def info(self) -> dict[str, Any]:
        return {"max_num_seqs": self.max_num_seqs, "prefill_batch_size": self.prefill_batch_size,
                "prefix_cache_mb": self._settings().prefix_cache_mb}

    def _settings(self) -> Any:
        from worker.settings import WorkerSettings

        # Its shapes compiled before it runs, as K's are: a background build would share the measured CPU.
        return WorkerSettings.from_env(max_num_seqs=self.max_num_seqs, prefill_batch_size=self.prefill_batch_size,
                                       decode_warmup="blocking")

    def _run(self, workload: Workload) -> list[RequestRecord]:
        from mlxq.bench.arm_mlxq import payload
        from worker.loading import engine_for_model
        from worker.scheduler import BatchScheduler

        settings = self._settings()
        engine = engine_for_model(settings, self.local.load(), self.local.tokenizer)
        scheduler = BatchScheduler(engine, max_num_seqs=settings.max_num_seqs,
                                   default_max_tokens=settings.default_max_tokens, limits=settings.limits,
                                   kv_budget_bytes=settings.kv_budget_bytes)
        records = drive_scheduler(scheduler, workload, payload)
        self.time_split = {f"engine_{name}": float(value) for name, value in engine.time_stats().items()}
        return records


def drive_scheduler(scheduler: Any, workload: Workload, make_payload: Callable[[BenchRequest], dict[str, Any]]
                    ) -> list[RequestRecord]:
    """Admit `workload`'s requests to a BatchScheduler as their arrivals say and step it until every
    one has ended: a record per request, in the order they ended, filled from its result
    (arm_mlxq.fill_from_result); times relative to the start."""
    from mlxq.bench.arm_mlxq import fill_from_result

    arrivals = Arrivals(workload)
    live: dict[str, tuple[BenchRequest, RequestRecord]] = {}
    records: list[RequestRecord] = []
    t0_wall, t0 = time.time(), time.perf_counter()

    def end(job_id: str, result: Any, now: float) -> None:
        request, record = live.pop(job_id)
        record.finished = now
        fill_from_result(record, result, t0_wall)
        records.append(record)
        arrivals.completed(request, now)

    while True:
        for request, arrival in arrivals.due(time.perf_counter() - t0):
            job_id = f"s{request.index}"
            live[job_id] = (request, RequestRecord(request.index, arrival))
            refused = scheduler.admit(job_id, make_payload(request))
            if refused is not None:
                end(job_id, refused, time.perf_counter() - t0)
        if not len(scheduler):
            if arrivals.exhausted:
                break
            _sleep_until(t0, arrivals.next_arrival())
            continue
        ended = scheduler.step()
        now = time.perf_counter() - t0
        for job in ended:
            end(job.id, job.result(), now)
    return records
