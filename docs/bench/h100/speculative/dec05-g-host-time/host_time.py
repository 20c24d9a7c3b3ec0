"""Where the host's time per engine call goes, without speculation and with prompt lookup: chat at 8 rows.

Both arms are engines in this process (mlxq/bench/spec_engines.py), warmed, then driven in turn (the order
reversed every other repeat). Each engine method named below is wrapped by a timer; a call's time is the
engine's decode seconds over its calls. Run from the checkout's root:
  python docs/bench/h100/speculative/dec05-g-host-time/host_time.py MODEL [REPEATS] [ROWS]
"""
import worker  # noqa: F401  (OpenBLAS before MLX)

import statistics
import sys
import time
from collections import defaultdict

from mlxq.bench.scenario_speculative import payload
from mlxq.bench.spec_engines import EngineArm
from mlxq.bench.spec_workloads import spec_prompts
from mlxq.bench.workloads import BenchRequest, all_at_once

ENGINE = ("_launch", "_collect")
SPECULATOR = ("step_began", "wants", "plan")


def timed(owner, name, totals, label=None):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label or name] += time.perf_counter() - started
    setattr(owner, name, wrapper)


def main() -> None:
    model, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    arms = {name: EngineArm({"MLXQ_SPECULATIVE": name, "MLXQ_PREFIX_CACHE_MB": "0"}, model, 32) for name in ("off", "ngram")}
    totals = {name: defaultdict(float) for name in arms}
    for name, arm in arms.items():
        arm.start()
        engine = arm.scheduler.engine
        for method in ENGINE:
            timed(engine, method, totals[name])
        if engine.speculator is not None:
            for method in SPECULATOR:
                timed(engine.speculator, method, totals[name])
            timed(engine.speculator.costs, "call", totals[name], "costs.call")
    tokenizer = arms["off"].scheduler.engine.tokenizer
    requests = [BenchRequest(i, p, 128) for i, p in enumerate(spec_prompts(tokenizer, "chat", rows))]
    per_call = {name: defaultdict(list) for name in arms}
    for repeat in range(repeats + 1):  # the first one warms
        order = list(arms.items()) if repeat % 2 else list(arms.items())[::-1]
        for name, arm in order:
            totals[name].clear()
            before = arm.time_counters()
            arm.drive(all_at_once(requests, f"chat-{rows}"), lambda r: payload(r, False))
            after = arm.time_counters()
            calls = after["engine_decode_steps"] - before.get("engine_decode_steps", 0)
            if repeat == 0:
                continue
            per_call[name]["call"].append((after["engine_decode_s"] - before["engine_decode_s"]) / calls)
            per_call[name]["passes"].append(after.get("engine_speculative_steps", 0) - before.get("engine_speculative_steps", 0))
            for method, seconds in totals[name].items():
                per_call[name][method].append(seconds / calls)
    for name, parts in per_call.items():
        line = "  ".join(f"{part} {statistics.median(values) * (1 if part == 'passes' else 1e3):.3f}"
                         for part, values in parts.items())
        print(f"{name:6s} medians over {repeats} repeats, ms a call:  {line}")
    print("each repeat's call, ms:", {name: [round(v * 1e3, 3) for v in parts["call"]] for name, parts in per_call.items()})


if __name__ == "__main__":
    main()
