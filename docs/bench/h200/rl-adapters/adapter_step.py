"""The compiled engine's decode step with every row on the base model against the same rows
spread over three LoRA adapters and the base model (request i names adapter i mod 4; the fourth
share has none), no Redis: `python docs/bench/h200/rl-adapters/adapter_step.py --model DIR --rows 64 256`.
Adapters: rank 8 on q, k, v and o of every layer (`make_tiny_adapter`), resident after a warm-up pass."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import worker  # noqa: F401  (OpenBLAS before MLX, on Linux)
import mlx.core as mx
from mlx_lm import load

from mlxq.bench.structured import _CountingEngine, _step_times
from worker.loading import engine_for_model
from worker.scheduler import BatchScheduler
from worker.settings import WorkerSettings
from worker.tiny_model import make_tiny_adapter

KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
NAMES = ("a0", "a1", "a2", None)


def requests(rows: int, tag: str, mixed: bool, new_tokens: int) -> dict[str, dict]:
    out = {}
    for i in range(rows):
        body = {"prompt_token_ids": [(i * 37 + k * 11) % 400 + 10 for k in range(64)], "max_tokens": new_tokens,
                "temperature": 0, "ignore_eos": True}
        if mixed and NAMES[i % 4] is not None:
            body["adapter"] = NAMES[i % 4]
        out[f"{tag}-{i}"] = body
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    adapters = Path(tempfile.mkdtemp())
    for seed, name in enumerate(NAMES[:3]):
        make_tiny_adapter(adapters / name, model, keys=KEYS, rank=8, scale=10.0, seed=100 + seed)
    report = {"device": str(mx.default_device()), "runs": {}}
    for rows in args.rows:
        settings = WorkerSettings(max_num_seqs=rows, prefill_batch_size=rows, prefix_cache_mb=0, decode="compiled",
                                  decode_warmup_tokens=0, adapter_dir=str(adapters))
        engine = _CountingEngine(engine_for_model(settings, model, tokenizer))
        scheduler = BatchScheduler(engine, max_num_seqs=rows, default_max_tokens=args.new_tokens)  # type: ignore[arg-type]
        for mixed in (False, True):  # warm-up: compiles each shape, with and without the stacks
            _step_times(scheduler, engine, requests(rows, f"warm{mixed}", mixed, args.new_tokens))
        runs = {"base": [], "mixed": []}
        for repeat in range(args.repeats):
            for arm in runs:
                mx.clear_cache()
                times = _step_times(scheduler, engine, requests(rows, f"{arm}{repeat}", arm == "mixed", args.new_tokens))
                runs[arm].append(statistics.median(times["step_ms"]))
        ratios = [m / b for m, b in zip(runs["mixed"], runs["base"])]
        report["runs"][rows] = {"step_p50_ms": runs, "mixed_over_base": ratios}
        print(f"{rows} rows: base {[round(x, 2) for x in runs['base']]} ms, mixed {[round(x, 2) for x in runs['mixed']]}"
              f" ms; mixed/base {[round(r, 2) for r in ratios]} (median {statistics.median(ratios):.2f})", flush=True)
        del engine, scheduler
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
