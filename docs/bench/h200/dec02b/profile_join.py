"""Where a late joiner's time goes inside the compiled engine, in process: 31 long sequences decode,
short ones join one at a time; each `step()` call is split into its parts (the joiner's prefill,
building the next step, handing it to the device, reading the previous one back).

`python docs/bench/h200/dec02b/profile_join.py --model DIR [--joins 16] [--out F.json]`
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import worker  # noqa: F401  (the worker's platform settings, before MLX loads)
import mlx.core as mx
from mlx_lm import load

from worker.engines.base import SamplingParams, SequenceSpec
from worker.engines.compiled import CompiledEngine

PARTS: dict[str, float] = {}


def timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PARTS[label] = PARTS.get(label, 0.0) + time.perf_counter() - started

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--long", type=int, default=31)
    parser.add_argument("--joins", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    engine = CompiledEngine(model, tokenizer, max_num_seqs=256)
    shapes, seconds = engine.warm_up(512, slots=[32, 48])
    print(f"warm-up {shapes} shapes {seconds:.1f} s", flush=True)
    timed(mx, "async_eval", "async_eval")
    timed(engine._admission, "admit", "admit")
    timed(engine, "_launch", "launch")
    timed(engine, "_collect", "collect")
    rng = random.Random(0)
    vocab = engine.vocab_size

    def spec(uid: str, max_tokens: int) -> SequenceSpec:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]
        return SequenceSpec(uid=uid, prompt_token_ids=prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                            request_id=uid)

    engine.add([spec(f"long{i}", 100_000) for i in range(args.long)])
    for _ in range(30):
        engine.step()

    def call() -> tuple[list[Any], float, dict[str, float]]:
        PARTS.clear()
        started = time.perf_counter()
        events = engine.step()
        return events, time.perf_counter() - started, dict(PARTS)

    plain = [call() for _ in range(100)]
    step_ms = statistics.median(c[1] for c in plain) * 1e3
    parts = {k: statistics.median(c[2].get(k, 0.0) for c in plain) * 1e3 for k in ("launch", "async_eval", "collect")}
    print(f"plain call {step_ms:.2f} ms; parts (median ms) {json.dumps({k: round(v, 2) for k, v in parts.items()})}",
          flush=True)
    joins = []
    for j in range(args.joins):
        for _ in range(rng.randrange(6, 14)):
            call()
        uid = f"short{j}"
        added = time.perf_counter()
        engine.add([spec(uid, 4)])
        calls = []
        while True:
            events, seconds, split = call()
            calls.append({"ms": round(seconds * 1e3, 2), **{k: round(v * 1e3, 2) for k, v in split.items()}})
            if any(e.uid == uid for e in events):
                break
        joins.append({"first_token_ms": round((time.perf_counter() - added) * 1e3, 2), "calls": calls})
    firsts = [j["first_token_ms"] for j in joins]
    print(f"joins: first token median {statistics.median(firsts):.2f} ms = {statistics.median(firsts) / step_ms:.2f} "
          f"calls of a plain step; each: {firsts}", flush=True)
    print("first join's calls:", joins[-1]["calls"], flush=True)
    if args.out:
        args.out.write_text(json.dumps({"plain_call_ms": step_ms, "plain_parts_ms": parts, "joins": joins}, indent=1))


if __name__ == "__main__":
    main()
