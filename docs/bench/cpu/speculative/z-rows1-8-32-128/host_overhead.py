"""The speculator's host work per engine call (step_began, wants, plan), off and ngram arms in one process.

Run from the repository: .venv/bin/python docs/bench/cpu/speculative/z-rows1-8-32-128/host_overhead.py MODEL_DIR 32 chat
"""
import sys, time, os
import worker  # BLAS trap: before mlx
from mlxq.bench.spec_engines import EngineArm
from mlxq.bench.spec_workloads import spec_prompts
from mlxq.bench.workloads import BenchRequest, Workload
from mlxq.bench.scenario_speculative import payload
from mlx_lm import load
from worker.engines.speculation.graded import GradedSpeculator  # prompt lookup's policy

model = sys.argv[1]; rows = int(sys.argv[2]); kind = sys.argv[3] if len(sys.argv) > 3 else "chat"
spent = {}
def wrap(cls, name):
    f = getattr(cls, name)
    def g(self, *a, **k):
        t = time.perf_counter()
        try: return f(self, *a, **k)
        finally: spent[name] = spent.get(name, 0) + time.perf_counter() - t
    setattr(cls, name, g)
for n in ("step_began", "wants", "plan"):
    wrap(GradedSpeculator, n)
tok = load(model, lazy=True)[1]
prompts = spec_prompts(tok, kind, rows)
wl = Workload("closed", f"{kind}-{rows}", [BenchRequest(i, p, 128) for i, p in enumerate(prompts)])
base = {"MLXQ_PREFIX_CACHE_MB": "0"}
arms = {name: EngineArm({**base, "MLXQ_SPECULATIVE": name}, model, rows) for name in ("off", "ngram")}
for a in arms.values(): a.start(); a.warm(wl)
for rep in range(3):
    for name, a in arms.items():
        spent.clear()
        before = a.time_counters()
        t = time.perf_counter()
        recs = a.drive(wl, lambda r: payload(r, False))
        wall = time.perf_counter() - t
        after = a.time_counters()
        steps = after["engine_decode_steps"] - before["engine_decode_steps"]
        print(f"{rep} {name:6s} wall {wall:.2f}s steps {steps:.0f} decode {after['engine_decode_s']-before['engine_decode_s']:.2f}s "
              + " ".join(f"{k} {v*1000/max(steps,1):.2f}ms/step" for k, v in spent.items()), flush=True)
