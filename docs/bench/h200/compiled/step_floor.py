"""The decode step at a fixed batch, against mlx-lm's BatchGenerator and the device's floor.

Every row holds a `--cache`-token prompt and decodes greedily; after both engines have started
all rows, the median of `--steps` steps is taken (each engine warmed up first: the compiled
engine's warm-up compiles its buckets, then 5 steps of each are not counted). The floor is the
weights plus the KV cache each step reads, over the copy bandwidth measured here, and the matmul
FLOPs over a measured bf16 matmul rate. Also: how long each shape took to compile, and a greedy
parity spot check of both engines (batched) against mlx-lm's generate_step (alone).

    python docs/bench/h200/compiled/step_floor.py --model DIR --rows 256 --cache 200 --out step_floor.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import worker  # noqa: F401  (a BLAS preload before MLX on Linux CPU; nothing on GPU)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step

from worker.engines.base import SequenceSpec
from worker.engines.compiled import CompiledEngine
from worker.engines.text import TextEngine
from worker.scheduler import BatchScheduler


def prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    return [[(i * 7919 + k * 104729) % (vocab - 10) + 5 for k in range(length)] for i in range(rows)]


def compiled_step_ms(model, tokenizer, rows: int, cache: int, steps: int, overlap: bool = True) -> tuple[float, dict]:
    engine = CompiledEngine(model, tokenizer, max_num_seqs=rows, prefill_batch_size=64, overlap=overlap)
    started = time.perf_counter()
    shapes, seconds = engine.warm_up(cache + steps + 16, slots=[rows])
    records = [{"slots": r.slots, "length": r.length, "s": round(r.seconds, 3)} for r in engine.compile_records]
    warm = {"shapes": shapes, "seconds": seconds, "wall_s": time.perf_counter() - started, "records": records}
    engine.add([SequenceSpec(uid=f"r{i}", prompt_token_ids=p, max_tokens=steps + 16)
                for i, p in enumerate(prompts(rows, cache, engine.vocab_size))])
    emitted: set[str] = set()
    while len(emitted) < rows:
        emitted.update(e.uid for e in engine.step())
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    warm["compiled_during_run"] = [r for r in engine.compile_records if not r.at_start]
    warm["compiled_during_run"] = [{"slots": r.slots, "length": r.length} for r in warm["compiled_during_run"]]
    return 1000 * statistics.median(times), warm


def batch_generator_step_ms(model, rows: int, cache: int, steps: int, vocab: int) -> float:
    generator = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=64)
    generator.insert(prompts(rows, cache, vocab), max_tokens=[steps + 16] * rows)
    started: set[int] = set()
    while len(started) < rows:
        started.update(r.uid for r in generator.next()[1])
    for _ in range(5):
        generator.next()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        generator.next()
        times.append(time.perf_counter() - t)
    generator.close()
    return 1000 * statistics.median(times)


def measured_bandwidth() -> float:
    """Bytes read plus written per second by an elementwise pass over 2 GiB of bf16."""
    x = mx.random.uniform(shape=(1 << 30,)).astype(mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        mx.eval(x * 1.5)
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def measured_matmul_flops() -> float:
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    b = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(a, b, a @ b)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    return 2 * 8192 ** 3 / statistics.median(times)


def parity(model, tokenizer, count: int = 16, new_tokens: int = 24) -> dict:
    requests = {f"p{i}": {"prompt_token_ids": prompts(count, 8 + 9 * i, len(tokenizer))[i], "max_tokens": new_tokens,
                          "temperature": 0, "ignore_eos": True} for i in range(count)}
    out = {}
    for name, cls in (("compiled", CompiledEngine), ("batch-generator", TextEngine)):
        scheduler = BatchScheduler(cls(model, tokenizer, max_num_seqs=count), max_num_seqs=count)
        for job_id, body in requests.items():
            assert scheduler.admit(job_id, body) is None
        results = {}
        while len(scheduler):
            results.update((e.id, e.result()) for e in scheduler.step())
        same = first_diff = 0
        for job_id, body in requests.items():
            alone = [int(t) for t, _ in generate_step(mx.array(body["prompt_token_ids"]), model,
                                                       max_tokens=new_tokens, sampler=lambda x: mx.argmax(x, -1))]
            got = results[job_id].choices[0].token_ids
            same += got == alone
            first_diff += next((j for j, (a, b) in enumerate(zip(got, alone)) if a != b), new_tokens)
        out[name] = {"identical_requests": same, "of": count, "mean_tokens_before_first_difference": first_diff / count}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--also-rows", type=int, default=32, help="a second batch size for the step times (0: none)")
    parser.add_argument("--cache", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="step_floor.json")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    report: dict = {"rows": args.rows, "cache_tokens": args.cache, "steps": args.steps,
                    "device": str(mx.default_device())}
    compiled_ms, warm = compiled_step_ms(model, tokenizer, args.rows, args.cache, args.steps)
    report["warm_up"] = warm
    report["compiled_engine_step_ms"] = compiled_ms
    print(f"compiled engine: {compiled_ms:.2f} ms a step; warm-up {warm['shapes']} shapes in {warm['seconds']:.1f} s",
          flush=True)
    vocab = len(tokenizer)
    report["batch_generator_step_ms"] = batch_generator_step_ms(model, args.rows, args.cache, args.steps, vocab)
    print(f"BatchGenerator: {report['batch_generator_step_ms']:.2f} ms a step", flush=True)
    report["compiled_engine_step_ms_no_overlap"] = compiled_step_ms(model, tokenizer, args.rows, args.cache, args.steps,
                                                                    overlap=False)[0]
    print(f"compiled engine, each step read back before the next: "
          f"{report['compiled_engine_step_ms_no_overlap']:.2f} ms a step", flush=True)
    if args.also_rows:
        rows = args.also_rows
        report[f"at_{rows}_rows"] = {
            "compiled_engine_step_ms": compiled_step_ms(model, tokenizer, rows, args.cache, args.steps)[0],
            "compiled_engine_step_ms_no_overlap": compiled_step_ms(model, tokenizer, rows, args.cache, args.steps,
                                                                   overlap=False)[0],
            "batch_generator_step_ms": batch_generator_step_ms(model, rows, args.cache, args.steps, vocab)}
        print(f"at {rows} rows: {report[f'at_{rows}_rows']}", flush=True)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    kv_per_token = CompiledEngine(model, tokenizer).kv_bytes_per_token
    kv_read = args.rows * (args.cache + args.steps // 2) * kv_per_token
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    bandwidth, flops = measured_bandwidth(), measured_matmul_flops()
    report["floor"] = {
        "weights_bytes": weights, "kv_bytes_read": kv_read, "bandwidth_bytes_per_s": bandwidth,
        "memory_ms": 1000 * (weights + kv_read) / bandwidth,
        "matmul_flop": 2 * params * args.rows, "matmul_flops_per_s": flops,
        "matmul_ms": 1000 * 2 * params * args.rows / flops,
    }
    print(f"floor: memory {report['floor']['memory_ms']:.3f} ms ({bandwidth / 1e12:.2f} TB/s), "
          f"matmul {report['floor']['matmul_ms']:.3f} ms ({flops / 1e12:.0f} TFLOP/s)", flush=True)
    report["parity_bf16"] = parity(model, tokenizer)
    print(f"parity: {report['parity_bf16']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
