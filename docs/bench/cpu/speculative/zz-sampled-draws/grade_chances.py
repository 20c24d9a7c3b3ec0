"""What prompt lookup's graded policy learnt of each grade, for greedy and for sampled rows: grounded
prompts at 8 rows, one engine in this process, REPEATS batches of each sampling, in turn. Prints each
grade's chance that a proposed token is accepted once the ones before it were, and the discounted
tokens tried it rests on (worker/engines/speculation/graded.py `GradeAcceptance`). Run from the
checkout's root:
  .venv/bin/python docs/bench/cpu/speculative/zz-sampled-draws/grade_chances.py MODEL [REPEATS]
"""
import worker  # noqa: F401  (OpenBLAS before MLX)

import sys

from mlxq.bench.scenario_speculative import payload
from mlxq.bench.spec_engines import EngineArm
from mlxq.bench.spec_workloads import spec_prompts
from mlxq.bench.workloads import BenchRequest, all_at_once


def main() -> None:
    model, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    arm = EngineArm({"MLXQ_SPECULATIVE": "ngram", "MLXQ_PREFIX_CACHE_MB": "0"}, model, 32)
    arm.start()
    prompts = spec_prompts(arm.scheduler.engine.tokenizer, "grounded", 8)
    for repeat in range(repeats):
        for temperature in (0.0, 0.7):
            requests = [BenchRequest(i, p, 128, temperature=temperature, seed=17 + i if temperature else None)
                        for i, p in enumerate(prompts)]
            arm.drive(all_at_once(requests, f"grounded-{temperature}"), lambda r: payload(r, False))
    grades = arm.scheduler.engine.speculator.grades
    print("grade (match length, greedy): chance a token is accepted, discounted tokens tried")
    for grade in sorted(grades._tried, key=lambda g: (not g[1], -g[0])):
        print(f"  {grade}: {grades.chance(grade):.2f}  ({grades._tried[grade]:.0f} tried)")
    arm.stop()


if __name__ == "__main__":
    main()
