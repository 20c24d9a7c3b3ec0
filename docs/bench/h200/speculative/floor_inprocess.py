"""The random draft's floor at one row, in one process: the worker's engine built twice from the same
settings, once without speculation and once with the tiny random draft, each request run on one and
then the other (the order swapped every repeat), so the spread between two worker processes does not
enter the ratio. Prints each arm's decode seconds and the ratio; writes them to OUT/floor_inprocess.json.

    python docs/bench/h200/speculative/floor_inprocess.py --model /tmp/real-bf16 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import worker  # noqa: F401  (the worker's platform settings before MLX)
from mlx_lm.utils import load_tokenizer

from mlxq.bench.scenario_speculative import random_draft
from mlxq.bench.spec_workloads import spec_prompts
from tests.reference import run_all
from worker.loading import build_scheduler
from worker.settings import WorkerSettings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = {"MLXQ_MAX_NUM_SEQS": "1", "MLXQ_DECODE_WARMUP": "blocking", "MLXQ_PREFIX_CACHE_MB": "0"}
    arms = {"off": {**common, "MLXQ_SPECULATIVE": "off"},
            "draft-random": {**common, "MLXQ_SPECULATIVE": "draft",
                             "MLXQ_DRAFT_MODEL": random_draft(args.model, out)}}
    schedulers = {arm: build_scheduler(WorkerSettings.from_env(env, model=args.model)) for arm, env in arms.items()}
    tokenizer = load_tokenizer(Path(args.model))
    report: dict = {"repeats": args.repeats, "tokens": args.tokens, "workloads": {}}
    for kind in ("grounded", "chat"):
        prompt = spec_prompts(tokenizer, kind, 1)[0]
        request = {"prompt_token_ids": list(prompt.ids), "max_tokens": args.tokens, "temperature": 0.0,
                   "ignore_eos": True}
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        for arm, scheduler in schedulers.items():  # a warm-up run each
            run_all(scheduler, {f"warm-{kind}": dict(request)})
        for repeat in range(args.repeats):
            for arm in (list(arms) if repeat % 2 == 0 else list(arms)[::-1]):
                started = time.perf_counter()
                results = run_all(schedulers[arm], {f"{kind}-{repeat}": dict(request)})
                seconds[arm].append(time.perf_counter() - started)
                assert len(results[f"{kind}-{repeat}"].choices[0].token_ids) == args.tokens
        counters = schedulers["draft-random"].engine.stats().counters
        summary = {"seconds": seconds,
                   "ratio_summed": sum(seconds["off"]) / sum(seconds["draft-random"]),
                   "ratio_median": statistics.median(a / b for a, b in zip(seconds["off"], seconds["draft-random"])),
                   "draft_counters": {k: v for k, v in counters.items() if k.startswith("speculative_")}}
        report["workloads"][kind] = summary
        print(f"{kind}: off {sum(seconds['off']):.2f} s, draft-random {sum(seconds['draft-random']):.2f} s "
              f"summed over {args.repeats}; tokens/s ratio {summary['ratio_summed']:.3f} summed, "
              f"{summary['ratio_median']:.3f} median; {summary['draft_counters']}", flush=True)
    (out / "floor_inprocess.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
