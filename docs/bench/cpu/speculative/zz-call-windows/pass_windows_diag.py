"""Prompt lookup on 8 grounded greedy rows of the real model, in this process: per run the
speculation counters, the median decode step per slot count, the measured pass costs and the
early-read cost (worker/engines/speculation/pass_cost.py); then one more run's calls, each with its
kind and its interval to the next call's start.

    PYTHONPATH=. .venv/bin/python docs/bench/cpu/speculative/zz-call-windows/pass_windows_diag.py "$(mlxq real-model)" 2
"""
import statistics
import sys
import time

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlxq.bench.arm_local import drive_scheduler
from mlxq.bench.arm_mlxq import payload as warm_payload
from mlxq.bench.spec_workloads import spec_prompts
from mlxq.bench.workloads import BenchRequest, all_at_once
from worker.engines.speculation.pass_cost import PassCosts
from worker.loading import build_scheduler
from worker.settings import WorkerSettings

model, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
env = {"MLXQ_MAX_NUM_SEQS": "8", "MLXQ_DECODE_WARMUP": "blocking", "MLXQ_SPECULATIVE": "ngram", "MLXQ_PREFIX_CACHE_MB": "0"}
scheduler = build_scheduler(WorkerSettings.from_env(env, model=model))
engine = scheduler.engine
speculator = engine._spec
requests = [BenchRequest(i, p, 128, client=i) for i, p in enumerate(spec_prompts(engine.tokenizer, "grounded", 8))]


def greedy(request: BenchRequest) -> dict:
    return {"prompt_token_ids": list(request.prompt.ids), "max_tokens": 128, "temperature": 0.0}


drive_scheduler(scheduler, all_at_once(requests, "warm-up"), warm_payload)
for run in range(runs):
    before, calls, started = dict(speculator.stats()), engine.time_stats()["decode_steps"], time.perf_counter()
    drive_scheduler(scheduler, all_at_once(requests, "grounded"), greedy)
    after, costs = speculator.stats(), speculator.costs
    print(f"run {run}: {time.perf_counter() - started:.2f} s, {engine.time_stats()['decode_steps'] - calls} calls,",
          {k.replace("speculative_", ""): after[k] - before.get(k, 0) for k in after})
    print("  median step ms:", {k: round(statistics.median(v) * 1e3, 1) for k, v in costs._steps.items()},
          "pass costs:", {k: round(costs.cost(*k), 2) for k in costs._passes},
          "early read:", {k: costs.early_read_cost(k) for k in costs._declined})

trace = []
record = PassCosts.call


def call(self, started, kind, slots, width=0):  # type: ignore[no-untyped-def]
    trace.append((started, kind.value, slots, width))
    record(self, started, kind, slots, width)


PassCosts.call = call
drive_scheduler(scheduler, all_at_once(requests, "grounded"), greedy)
for (started, kind, slots, width), following in zip(trace, trace[1:]):
    print(f"{kind:>9} slots {slots} width {width} {1e3 * (following[0] - started):7.1f} ms")
