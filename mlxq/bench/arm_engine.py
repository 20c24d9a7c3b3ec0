"""Arm K: mlxq's compiled decode engine (worker/engines/compiled.py) alone in the bench's process,
fed through the Engine protocol exactly as arm B feeds mlx-lm's BatchGenerator: every request
known when it arrives, no scheduler, queue or worker loop. K/B is the engine against mlx-lm's own.

The engine is built when the arm starts, with the decode step compiled for the workloads' buckets
up front (what a worker does at start-up), and kept for every workload of that start.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mlxq.bench.arm_local import LocalModel, _BatchingArm, _sleep_until
from mlxq.bench.arms import ArmSkipped
from mlxq.bench.workloads import Arrivals, BenchRequest, RequestRecord, Workload


class CompiledEngineArm(_BatchingArm):
    key = "K"
    methods = {
        "queue": "none: a request is added to the engine the moment it arrives",
        "ttft": "arrival to the end of the engine step that returned its first token",
        "e2e": "arrival to the end of the step that returned its last token",
        "eos": "sequences have no stop tokens",
    }

    def __init__(self, local: LocalModel, max_num_seqs: int, prefill_batch_size: int, warmup_tokens: int) -> None:
        super().__init__(local, max_num_seqs, prefill_batch_size)
        self.warmup_tokens = warmup_tokens
        self.engine: Any = None
        self.warmup: dict[str, float] = {}
        # MLXQ_BENCH_K_OVERLAP=0: every step read back before the next is built (CompiledEngine(overlap=False)).
        self.overlap = os.environ.get("MLXQ_BENCH_K_OVERLAP", "1") != "0"

    def start(self) -> None:
        from worker.engines.compiled import CompiledEngine
        from worker.engines.decode_path import choose_decode_path

        model = self.local.load()
        path = choose_decode_path(model, "auto")
        if path.name != "compiled":
            raise ArmSkipped(f"the compiled decode path does not run this model: {path.reason}")
        self.engine = CompiledEngine(model, self.local.tokenizer, max_num_seqs=self.max_num_seqs,
                                     prefill_batch_size=self.prefill_batch_size, overlap=self.overlap)
        shapes, seconds = self.engine.warm_up(self.warmup_tokens)
        self.warmup = {"shapes": shapes, "seconds": seconds}

    def stop(self) -> None:
        self.engine = None  # it holds the model: the runner unloads it after the in-process arms

    def info(self) -> dict[str, Any]:
        return {"max_num_seqs": self.max_num_seqs, "prefill_batch_size": self.prefill_batch_size,
                "overlap": self.overlap,
                "warm_up": self.warmup, "compiled_shapes": len(self.engine.compiled_shapes) if self.engine else 0}

    def _run(self, workload: Workload) -> list[RequestRecord]:
        from worker.engines.base import SamplingParams, SequenceSpec

        engine = self.engine
        before = dict(engine.time_stats())
        arrivals = Arrivals(workload)
        live: dict[str, tuple[BenchRequest, RequestRecord]] = {}  # a choice's uid -> its request and record
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        while True:
            due = arrivals.due(time.perf_counter() - t0)
            specs = []
            for request, arrival in due:
                record = RequestRecord(request.index, arrival, started=arrival, extra={"token_ids": []})
                sampling = SamplingParams(temperature=request.temperature, seed=request.seed)
                for choice in range(request.n):
                    uid = f"k{request.index}.{choice}"
                    live[uid] = (request, record)
                    specs.append(SequenceSpec(uid=uid, prompt_token_ids=list(request.prompt.ids),
                                              max_tokens=request.max_tokens, sampling=sampling,
                                              choice_index=choice, request_id=f"k{request.index}"))
            if specs:
                engine.add(specs)
            if not live:
                if arrivals.exhausted:
                    break
                _sleep_until(t0, arrivals.next_arrival())
                continue
            events = engine.step()
            now = time.perf_counter() - t0
            for event in events:
                request, record = live[event.uid]
                if record.first_token is None:
                    record.first_token = now
                record.tokens += 1
                if event.index == 0 and event.error is None and not event.empty:
                    record.extra["token_ids"].append(int(event.token))
                if event.finish_reason is not None or event.error is not None:
                    record.error = record.error or event.error
                    del live[event.uid]
                    if not any(entry[1] is record for entry in live.values()):
                        record.finished = now
                        records.append(record)
                        arrivals.completed(request, now)
        after = engine.time_stats()
        self.time_split = {f"engine_{k}": float(after[k]) - float(before.get(k, 0)) for k in after}
        return records
