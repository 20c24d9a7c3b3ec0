"""The compiled engine's decode step and a late joiner's first token, in process, against mlx-lm's
BatchGenerator; run once per MLX environment setting (the CUDA graph knobs are read at start).

    python docs/bench/h200/joiner/joiner_env.py --model DIR --label default --out env-default.json \
        [--engine-file FILE]   # the compiled engine of another commit's compiled.py instead

The joiner: 31 rows decode (128-token prompts); a 32nd request with a 128-token prompt is added
and the engine stepped until its first token: milliseconds from `add` to that event, and engine
calls. Five joins, each 24 steps apart; the first is not counted (it builds the shapes a join needs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import worker  # noqa: F401  (the BLAS preload on Linux CPU; nothing on GPU)
import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiled"))
import step_floor  # noqa: E402
from step_floor import batch_generator_step_ms, compiled_step_ms, prompts  # noqa: E402

from worker.engines.base import SequenceSpec  # noqa: E402
from worker.engines.compiled import CompiledEngine  # noqa: E402


def joiner(engine_cls, model, tokenizer, rows: int = 31, prompt: int = 128, joins: int = 5) -> dict:
    engine = engine_cls(model, tokenizer, max_num_seqs=64, prefill_batch_size=64)
    engine.warm_up(prompt + 200, slots=[32])
    ps = prompts(rows + joins, prompt, engine.vocab_size)
    engine.add([SequenceSpec(uid=f"r{i}", prompt_token_ids=ps[i], max_tokens=1000) for i in range(rows)])
    emitted: set[str] = set()
    while len(emitted) < rows:
        emitted.update(e.uid for e in engine.step())
    steps = []
    for _ in range(24):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    step_s = statistics.median(steps)
    out = []
    for j in range(joins):
        t = time.perf_counter()
        engine.add([SequenceSpec(uid=f"j{j}", prompt_token_ids=ps[rows + j], max_tokens=2)])
        calls = 0
        while True:
            events = engine.step()
            calls += 1
            if any(e.uid == f"j{j}" for e in events):
                break
        out.append({"ms": 1000 * (time.perf_counter() - t), "calls": calls})
        for _ in range(24):
            engine.step()
    counted = out[1:]
    ms = statistics.median(o["ms"] for o in counted)
    return {"step_ms": 1000 * step_s, "joins": out, "first_token_ms_median": ms,
            "first_token_in_steps": ms / (1000 * step_s)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine-file")
    parser.add_argument("--rows", default="32,256")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    engine_cls = CompiledEngine
    if args.engine_file:
        spec = importlib.util.spec_from_file_location("compiled_other", args.engine_file)
        other = importlib.util.module_from_spec(spec)
        sys.modules["compiled_other"] = other  # (its dataclasses look their module up)
        spec.loader.exec_module(other)
        engine_cls = step_floor.CompiledEngine = other.CompiledEngine
    model, tokenizer = load(args.model)
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    report: dict = {"label": args.label, "env": env, "device": str(mx.default_device()),
                    "engine_file": args.engine_file}
    for rows in [int(r) for r in args.rows.split(",") if r]:
        k_ms, warm = compiled_step_ms(model, tokenizer, rows, 200, args.steps)
        b_ms = batch_generator_step_ms(model, rows, 200, args.steps, len(tokenizer))
        report[f"rows_{rows}"] = {"K_step_ms": k_ms, "B_step_ms": b_ms, "B_over_K": b_ms / k_ms,
                                  "K_warm_s": warm["seconds"]}
        print(args.label, rows, f"K {k_ms:.2f} ms  B {b_ms:.2f} ms  B/K {b_ms / k_ms:.2f}", flush=True)
    report["joiner"] = joiner(engine_cls, model, tokenizer)
    print(args.label, "joiner", {k: v for k, v in report["joiner"].items() if k != "joins"}, flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
