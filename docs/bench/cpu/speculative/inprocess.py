"""Speculation against none in one process: the worker's engine built once per arm from the same
settings, each batch of requests run on every arm in turn (the order rotated every repeat), so the
spread between two worker processes (the bench's `control` arm reads 0.86-1.26 on this CPU) does not
enter the ratios. Per rows x workload: each arm's wall, prefill and decode seconds summed over the
repeats, off / arm ratios of those sums and the median of the repeats' own, the speculation
counters, and whether every greedy request wrote off's tokens. Writes OUT/inprocess.json.

    PYTHONPATH=. python docs/bench/cpu/speculative/inprocess.py --model "$(mlxq real-model)" --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import worker  # noqa: F401  (the worker's platform settings before MLX)

from mlxq.bench.scenario_speculative import random_draft
from mlxq.bench.spec_workloads import spec_prompts
from tests.reference import run_all
from worker.loading import build_scheduler
from worker.settings import WorkerSettings


def arm_settings(arm: str, model: str, out: Path) -> dict[str, str]:
    if arm in ("off", "control"):
        return {"MLXQ_SPECULATIVE": "off"}
    if arm == "ngram":
        return {"MLXQ_SPECULATIVE": "ngram"}
    if arm == "draft-random":
        return {"MLXQ_SPECULATIVE": "draft", "MLXQ_DRAFT_MODEL": random_draft(model, out)}
    raise SystemExit(f"--arms: unknown arm {arm!r}")


def measure(schedulers: dict[str, Any], requests: dict[str, dict], repeats: int) -> dict[str, Any]:
    arms = list(schedulers)
    for arm in arms:  # a warm-up run each
        run_all(schedulers[arm], {f"warm-{arm}-{uid}": dict(r) for uid, r in requests.items()})
    seconds = {arm: {"wall": [], "prefill": [], "decode": []} for arm in arms}
    tokens: dict[str, dict[str, list[int]]] = {}
    for repeat in range(repeats):
        for arm in arms[repeat % len(arms):] + arms[:repeat % len(arms)]:
            engine = schedulers[arm].engine
            before = engine.stats().counters
            started = time.perf_counter()
            results = run_all(schedulers[arm], {f"{arm}-{repeat}-{uid}": dict(r) for uid, r in requests.items()})
            seconds[arm]["wall"].append(time.perf_counter() - started)
            after = engine.stats().counters
            for part in ("prefill", "decode"):
                seconds[arm][part].append(after.get(f"{part}_s", 0.0) - before.get(f"{part}_s", 0.0))
            tokens[arm] = {uid: results[f"{arm}-{repeat}-{uid}"].choices[0].token_ids for uid in requests}
    report: dict[str, Any] = {}
    for arm in arms:
        counters = schedulers[arm].engine.stats().counters
        report[arm] = {
            "seconds": seconds[arm],
            "tokens": sum(len(t) for t in tokens[arm].values()),
            "same_tokens_as_off": tokens[arm] == tokens["off"],
            "ratio_wall": sum(seconds["off"]["wall"]) / sum(seconds[arm]["wall"]),
            "ratio_wall_median": statistics.median(o / a for o, a in zip(seconds["off"]["wall"], seconds[arm]["wall"])),
            "ratio_decode": sum(seconds["off"]["decode"]) / sum(seconds[arm]["decode"]),
            "counters": {k: v for k, v in counters.items() if k.startswith("speculative_") or k == "decode_steps"},
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arms", default="off,ngram,draft-random,control", help="off first")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="most new tokens a request makes (ending at EOS)")
    parser.add_argument("--ignore-eos", action="store_true", help="every request makes --tokens tokens")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    assert arms[0] == "off", "--arms: off comes first (every ratio is off / arm)"
    report: dict[str, Any] = {"arms": arms, "repeats": args.repeats, "tokens": args.tokens,
                              "ignore_eos": args.ignore_eos, "runs": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        common = {"MLXQ_MAX_NUM_SEQS": str(rows), "MLXQ_DECODE_WARMUP": "blocking", "MLXQ_PREFIX_CACHE_MB": "0"}
        schedulers = {arm: build_scheduler(WorkerSettings.from_env({**common, **arm_settings(arm, args.model, out)},
                                                                   model=args.model)) for arm in arms}
        tokenizer = schedulers["off"].engine.tokenizer
        for kind in args.workloads.split(","):
            requests = {str(i): {"prompt_token_ids": list(p.ids), "max_tokens": args.tokens, "temperature": 0.0,
                                 "ignore_eos": args.ignore_eos}
                        for i, p in enumerate(spec_prompts(tokenizer, kind, rows))}
            run = report["runs"][f"{kind}-{rows}"] = measure(schedulers, requests, args.repeats)
            for arm, r in run.items():
                print(f"{kind} {rows} rows {arm}: wall {sum(r['seconds']['wall']):.2f} s "
                      f"(prefill {sum(r['seconds']['prefill']):.2f}, decode {sum(r['seconds']['decode']):.2f}); "
                      f"off/arm wall {r['ratio_wall']:.3f} (median {r['ratio_wall_median']:.3f}), "
                      f"decode {r['ratio_decode']:.3f}; off's tokens: {r['same_tokens_as_off']}; {r['counters']}",
                      flush=True)
            (out / "inprocess.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
