"""Scenario `startup`: how soon a fresh worker answers, and what it decodes at then and later, on
each decode path (MLXQ_DECODE=batch-generator, then auto: mlxq's compiled engine where it is exact).

For each path of --startup-paths (and each --repeats), one worker process starts with its first job already queued
(a --prompt-tokens prompt, --new-tokens greedy tokens): `first_answer_s` is the process's start to
that job's result. With --startup-cold (the default) each worker gets an empty kernel cache (its own
TMPDIR), as on a machine that never ran this model: the compiled engine's kernels are built then.
Then a wave of --startup-wave requests at once, right away (`early`), and again once the worker's
kernel prebuild has ended (`settled`; worker/engines/kernel_prebuild.py): tokens/s of each.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Callable, Optional

from mlxq.bench.arm_mlxq import MlxqCluster, drive, payload
from mlxq.bench.config import BenchConfig
from mlxq.bench.stats import summarize
from mlxq.bench.workloads import BenchRequest, Tokenizer, all_at_once, make_prompts

# --startup-paths: a worker's MLXQ_DECODE, or "blocking" (auto with MLXQ_DECODE_WARMUP=blocking: every
# shape compiled before the first job, as before kernels were built in the background)
PATHS = ("batch-generator", "auto", "blocking")
PATH_ENV = {"batch-generator": {"MLXQ_DECODE": "batch-generator"}, "auto": {"MLXQ_DECODE": "auto"},
            "blocking": {"MLXQ_DECODE": "auto", "MLXQ_DECODE_WARMUP": "blocking"}}
SETTLE_TIMEOUT_S = 900.0


def startup(cfg: BenchConfig, tokenizer: Tokenizer,
            make_cluster: Callable[[int, int, Optional[dict[str, str]]], MlxqCluster]) -> dict[str, Any]:
    first = make_prompts(tokenizer, 1, cfg.prompt_tokens, seed=cfg.seed, salt="startup")[0]
    probe = payload(BenchRequest(0, first, cfg.new_tokens))
    out: dict[str, Any] = {"cold": cfg.startup_cold, "prompt_tokens": len(first.ids), "new_tokens": cfg.new_tokens,
                           "wave": cfg.startup_wave, "paths": {}}
    texts: dict[str, list[int]] = {}
    for repeat in range(cfg.repeats):
        for path in cfg.startup_paths:
            run = _one(cfg, tokenizer, make_cluster, path, probe, repeat, texts)
            out["paths"].setdefault(path, []).append(run)
            print(f"   {path}: first answer {run['first_answer_s']:.1f} s after the start; "
                  f"wave early {run['early_tokens_per_s']:.1f} tok/s, settled {run['settled_tokens_per_s']:.1f} tok/s"
                  + (f" (kernels built after {run['settled_after_s']:.0f} s)" if run.get("settled_after_s") else ""),
                  flush=True)
    out["same_first_answer"] = len({tuple(t) for t in texts.values()}) == 1
    for path, runs in out["paths"].items():
        out[path] = {key: statistics.median(r[key] for r in runs)
                     for key in ("first_answer_s", "early_tokens_per_s", "settled_tokens_per_s")}
    b, c = out.get("batch-generator"), out.get("auto")
    if b and c:
        out["first_answer_ratio"] = c["first_answer_s"] / b["first_answer_s"]
        out["settled_ratio"] = c["settled_tokens_per_s"] / b["settled_tokens_per_s"]
    return out


def _one(cfg: BenchConfig, tokenizer: Tokenizer, make_cluster: Callable[..., MlxqCluster], path: str,
         probe: dict[str, Any], repeat: int, texts: dict[str, list[int]]) -> dict[str, Any]:
    env = dict(PATH_ENV[path])
    if cfg.startup_cold:
        cfg.logs.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = tempfile.mkdtemp(prefix=f"kernels-{path}-", dir=cfg.logs)
    cluster = make_cluster(1, cfg.max_num_seqs, env)
    started = time.perf_counter()
    try:
        result = cluster.start(probe=probe)[0]
        first_answer_s = time.perf_counter() - started
        texts[path] = result.choices[0].token_ids if result.choices else []
        run: dict[str, Any] = {"first_answer_s": first_answer_s, "ttft_s": result.timings.ttft_s,
                               "first_job_engine": cluster.worker_stats("engine_")}
        run["early_tokens_per_s"] = _wave(cfg, tokenizer, cluster, f"early-{path}-{repeat}")
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        tick = {**probe, "max_tokens": 1}  # the stats hash is written as jobs end
        while cluster.worker_stats("engine_").get("kernels_prebuilding") == "1" and time.monotonic() < deadline:
            time.sleep(2.0)
            cluster.results([cluster.client.submit(tick, queue=cluster.queue)], 120.0)
        if path == "auto":
            run["settled_after_s"] = time.perf_counter() - started
        _wave(cfg, tokenizer, cluster, f"compile-{path}-{repeat}")  # each shape compiles at its first step
        run["settled_tokens_per_s"] = _wave(cfg, tokenizer, cluster, f"settled-{path}-{repeat}")
        run["engine"] = cluster.worker_stats("engine_")
        return run
    finally:
        cluster.stop()


def _wave(cfg: BenchConfig, tokenizer: Tokenizer, cluster: MlxqCluster, salt: str) -> float:
    prompts = make_prompts(tokenizer, cfg.startup_wave, cfg.prompt_tokens, seed=cfg.seed, salt=salt)
    workload = all_at_once([BenchRequest(i, p, cfg.new_tokens) for i, p in enumerate(prompts)], salt)
    return float(summarize(workload, drive(cluster, workload, cfg.request_timeout_s))["tokens_per_s"] or 0.0)


def startup_line(s: dict[str, Any]) -> str:
    b, c, w = s.get("batch-generator", {}), s.get("auto", {}), s.get("blocking")

    def f(x: Any, digits: int = 1) -> str:
        return "—" if x is None else f"{x:,.{digits}f}"

    blocking = (f"; with the blocking warm-up: first answer {f(w.get('first_answer_s'))} s, then "
                f"{f(w.get('settled_tokens_per_s'))} tok/s") if w else ""
    return (f"- start-up ({'empty kernel cache' if s['cold'] else 'kernels on disk'}; first job "
            f"{s['prompt_tokens']}+{s['new_tokens']} tokens, queued before the worker started): first answer "
            f"{f(c.get('first_answer_s'))} s compiled path vs {f(b.get('first_answer_s'))} s BatchGenerator "
            f"({f(s.get('first_answer_ratio'), 2)}x); {s['wave']} requests at once right after: "
            f"{f(c.get('early_tokens_per_s'))} vs {f(b.get('early_tokens_per_s'))} tok/s; once the kernels are "
            f"built: {f(c.get('settled_tokens_per_s'))} vs {f(b.get('settled_tokens_per_s'))} tok/s "
            f"({f(s.get('settled_ratio'), 2)}x); the same first answer on every path: {s.get('same_first_answer')}"
            + blocking)
