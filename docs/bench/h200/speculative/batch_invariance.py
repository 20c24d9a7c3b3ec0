"""Whether a greedy or seeded request's tokens depend on the batch it ran in, with and without speculation.

Each arm's engine is built once from the worker's settings (worker/loading.py); every prompt of a
workload runs alone (one row), then in batches of each --rows count. For each request: whether its
tokens in a batch equal its tokens alone, and whether an arm's tokens alone equal `off`'s alone; where
they differ, the index of the first token that differs. Writes OUT/batch_invariance.json.

    PYTHONPATH=. python docs/bench/h200/speculative/batch_invariance.py --model /tmp/real-bf16 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import worker  # noqa: F401  (the worker's platform settings before MLX)

from mlxq.bench.spec_workloads import spec_prompts
from tests.reference import run_all
from worker.loading import build_scheduler
from worker.settings import WorkerSettings


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where `a` and `b` differ (the shorter one's length if one is a
    prefix of the other), None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(scheduler: Any, requests: list[dict], batch: int) -> list[list[int]]:
    tokens: list[list[int]] = []
    for start in range(0, len(requests), batch):
        chunk = {str(start + i): r for i, r in enumerate(requests[start:start + batch])}
        results = run_all(scheduler, chunk)
        tokens += [results[uid].choices[0].token_ids for uid in chunk]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arms", default="off,ngram", help="off first; off, ngram or draft-self (the model as its own draft)")
    parser.add_argument("--rows", default="8,32", help="the batch sizes, each compared with the requests alone")
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--sampling", default="greedy", help="greedy and/or seeded (temperature 0.7, a seed each)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in args.rows.split(",")]
    arms = args.arms.split(",")
    assert arms[0] == "off", "--arms: off comes first"
    env = {"MLXQ_MAX_NUM_SEQS": str(max(rows)), "MLXQ_DECODE_WARMUP": "blocking", "MLXQ_PREFIX_CACHE_MB": "0"}
    report: dict[str, Any] = {"model": args.model, "rows": rows, "tokens": args.tokens, "runs": {}}
    alone_off: dict[str, list[list[int]]] = {}
    for arm in arms:
        speculation = ({"MLXQ_SPECULATIVE": "draft", "MLXQ_DRAFT_MODEL": args.model} if arm == "draft-self"
                       else {"MLXQ_SPECULATIVE": arm})
        scheduler = build_scheduler(WorkerSettings.from_env({**env, **speculation}, model=args.model))
        for kind, sampling in ((k, s) for k in args.workloads.split(",") for s in args.sampling.split(",")):
            prompts = spec_prompts(scheduler.engine.tokenizer, kind, max(rows))
            requests = [{"prompt_token_ids": list(p.ids), "max_tokens": args.tokens, "temperature": 0.0}
                        if sampling == "greedy" else
                        {"prompt_token_ids": list(p.ids), "max_tokens": args.tokens, "temperature": 0.7, "seed": i}
                        for i, p in enumerate(prompts)]
            kind = f"{kind}-{sampling}"
            run(scheduler, requests[:max(rows)], max(rows))  # every shape traced before the compared runs
            alone = run(scheduler, requests, 1)
            alone_off.setdefault(kind, alone)
            entry: dict[str, Any] = {"alone_vs_off_alone": [first_difference(a, o) for a, o in
                                                             zip(alone, alone_off[kind])]}
            for batch in rows:
                batched = run(scheduler, requests, batch)
                entry[f"batch_{batch}_vs_alone"] = [first_difference(b, a) for b, a in zip(batched, alone)]
            report["runs"][f"{arm}-{kind}"] = entry
            summary = {key: f"{sum(d is None for d in diffs)}/{len(diffs)} equal, first differences "
                            f"{sorted(d for d in diffs if d is not None)}" for key, diffs in entry.items()}
            print(arm, kind, json.dumps(summary), flush=True)
            (out / "batch_invariance.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
