"""`mlxq bench --scenario rl`, mixed adapters (docs/rl.md, "Adapters"): the throughput of requests
for several LoRA adapters (and the base model) decoding in one batch, against the same requests
without adapters, through one worker.

Random LoRA adapters for the served model are written in mlx-lm's layout (rank 8, every attention
projection of every layer) into a folder the worker serves (`MLXQ_ADAPTER_DIR`). A warm-up pass runs
every adapter once (the adapters become resident; the decode step compiles its shapes with and
without the LoRA stacks). Then, each round, the same requests run twice, submitted at once: without
adapters, and with request i naming adapter i mod (adapters + 1) (the last share: the base model).
Tokens/s is the completion tokens over the span from the first job's start to the last one's end.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

from mlxq.bench.arm_mlxq import JOB_TIMEOUT_S, MlxqCluster
from mlxq.bench.config import BenchConfig
from mlxq.bench.procs import ProcessSet
from mlxq.bench.stats import median
from mlxq.bench.workloads import Tokenizer, make_prompts
from schemas import GenerationResult

ADAPTERS = 3
RANK = 8
KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def write_adapters(model_path: str, directory: Path, count: int = ADAPTERS) -> list[str]:
    """`count` random adapters for the model, as subdirectories of `directory`; their names."""
    from mlx_lm import load

    from worker.tiny_model import make_tiny_adapter

    model, _ = load(model_path)
    names = [f"bench-{i}" for i in range(count)]
    for i, name in enumerate(names):
        make_tiny_adapter(directory / name, model, keys=KEYS, rank=RANK, scale=10.0, seed=100 + i)
    return names


def mixed_adapters(cfg: BenchConfig, url: str, procs: ProcessSet, model: str, blas_path: Optional[str],
                   tokenizer: Tokenizer) -> dict[str, Any]:
    sequences = cfg.rl_swap_sequences
    prompts = make_prompts(tokenizer, sequences, cfg.prompt_tokens, seed=cfg.seed, salt="rl-adapters")
    base = [{"prompt_token_ids": list(p.ids), "max_tokens": cfg.rl_swap_new_tokens, "temperature": 1.0,
             "seed": i, "ignore_eos": True} for i, p in enumerate(prompts)]
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-adapters-") as tmp:
        names = write_adapters(model, Path(tmp))
        choices: list[Optional[str]] = [*names, None]
        mixed = [{**r, **({"adapter": choices[i % len(choices)]} if choices[i % len(choices)] else {})}
                 for i, r in enumerate(base)]
        cluster = MlxqCluster(url, model, 1, sequences, cfg.prefill_batch_size, procs, blas_path=blas_path,
                              env={"MLXQ_ADAPTER_DIR": tmp})
        cluster.start()
        rounds = []
        try:
            _run(cluster, mixed[:len(choices) * 2])  # warm-up: adapters resident, shapes compiled
            _run(cluster, base[:len(choices) * 2])
            for _ in range(cfg.rl_swap_rounds):
                rounds.append({"base": _throughput(_run(cluster, base)), "mixed": _throughput(_run(cluster, mixed))})
            stats = {k: v for k, v in cluster.worker_stats("engine_").items() if "adapter" in k}
        finally:
            cluster.stop()
    base_tps = median([r["base"]["tokens_per_s"] for r in rounds])
    mixed_tps = median([r["mixed"]["tokens_per_s"] for r in rounds])
    return {"status": "measured", "adapters": len(names), "rank": RANK, "layers": list(KEYS),
            "requests": sequences, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.rl_swap_new_tokens,
            "base_tokens_per_s": base_tps, "mixed_tokens_per_s": mixed_tps,
            "ratio": mixed_tps / base_tps if base_tps and mixed_tps else None, "rounds": rounds,
            "worker_adapter_counters": stats,
            "method": f"one worker (max_num_seqs = requests); the same {sequences} requests (temperature 1.0, "
                      "seeded, ignore_eos) submitted at once, without adapters, then with request i naming adapter "
                      f"i mod {len(choices)} ({len(names)} random rank-{RANK} adapters on every attention "
                      "projection, and the base model); tokens/s = completion tokens / (last finished_at - first "
                      "started_at); medians over rounds after a warm-up pass of each"}


def _run(cluster: MlxqCluster, requests: list[dict[str, Any]]) -> list[GenerationResult]:
    assert cluster.client is not None
    ids = cluster.client.submit_many(requests, queue=cluster.queue, timeout=JOB_TIMEOUT_S)
    results = cluster.results(ids, 1800.0)
    failed = [r for r in results if r.status != "finished"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} adapter bench jobs failed, e.g. {failed[0].error}")
    return results


def _throughput(results: list[GenerationResult]) -> dict[str, Any]:
    tokens = sum(r.usage.completion_tokens for r in results)
    started = min(r.timings.started_at or 0.0 for r in results)
    finished = max(r.timings.finished_at or 0.0 for r in results)
    span = finished - started
    return {"tokens": tokens, "seconds": round(span, 3), "tokens_per_s": tokens / span if span > 0 else None}


def adapter_lines(a: dict[str, Any]) -> list[str]:
    """table.md's line for the mixed-adapter part."""
    if a.get("status") != "measured":
        return [f"- RL mixed-adapter throughput: {a.get('status')} ({a.get('reason')})"]
    return [f"- RL mixed adapters: {a['requests']} requests ({a['prompt_tokens']} + {a['new_tokens']} tokens) on one "
            f"worker, {a['adapters']} rank-{a['rank']} adapters and the base model in one batch: "
            f"{a['mixed_tokens_per_s']:.1f} tok/s against {a['base_tokens_per_s']:.1f} tok/s without adapters "
            f"(x{a['ratio']:.2f})"]
