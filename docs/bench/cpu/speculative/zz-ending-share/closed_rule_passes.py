"""Which passes prompt lookup's policy runs on open chat at 8 rows in a closed batch: the worker's
engine in this process, greedy, 128 tokens, the pass cost fixed at 1.15 (a GPU's) so that passes are
as cheap as there; each pass's rows, how far ahead each row is, and the share of rows ending early.
Run from the checkout's root: .venv/bin/python docs/bench/cpu/speculative/zz-ending-share/closed_rule_passes.py "$(mlxq real-model)"
"""
import worker  # noqa: F401  (OpenBLAS before MLX)

import sys

from mlxq.bench.scenario_speculative import payload
from mlxq.bench.spec_engines import EngineArm
from mlxq.bench.spec_workloads import spec_prompts
from mlxq.bench.workloads import BenchRequest, all_at_once


def main() -> None:
    arm = EngineArm({"MLXQ_SPECULATIVE": "ngram", "MLXQ_SPECULATIVE_PASS_COST": "1.15", "MLXQ_PREFIX_CACHE_MB": "0"},
                    sys.argv[1], 32)
    arm.start()
    speculator = arm.scheduler.engine.speculator
    passes = []
    planned = speculator._plan

    def plan(rows, slot_count):
        made = planned(rows, slot_count)
        if made is not None:
            ahead = speculator._ahead(rows)
            passes.append((made.width, sorted(ahead.values()), [(len(r.draft), ahead[r.seq.spec.uid]) for r in made.rows]))
        return made
    speculator._plan = plan
    tokenizer = arm.scheduler.engine.tokenizer
    prompts = spec_prompts(tokenizer, "chat", 8)
    arm.warm(all_at_once([BenchRequest(i, p, 32) for i, p in enumerate(prompts)], "warm"))
    for repeat in range(3):
        passes.clear()
        before = arm.time_counters()
        arm.drive(all_at_once([BenchRequest(i, p, 128) for i, p in enumerate(prompts)], f"chat-{repeat}"),
                  lambda r: payload(r, False))
        calls = arm.time_counters()["engine_decode_steps"] - before.get("engine_decode_steps", 0)
        print(f"repeat {repeat}: {len(passes)} passes, {calls:.0f} calls, shares ending early {speculator.endings.shares()}")
        for width, ahead, rows in passes[:10]:
            print(f"  width {width}, rows ahead by {ahead}, proposals (length, ahead by) {rows}")
    arm.stop()


if __name__ == "__main__":
    main()
