"""Where a decode step's time goes: one model step at `--rows` rows and a ~`--cache`-token cache,
greedy, evaluated each step, for several ways of building it. Prints, per variant, the median of
the whole step and of the host's part (building the graph until `mx.async_eval` returns).

    python docs/bench/h200/compiled/step_variants.py --model DIR --rows 256 --cache 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import worker  # noqa: F401
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from worker.engines.slot_cache import KVLayout, SlotBuffers, SlotLayerCache


class NoMaskCache(SlotLayerCache):
    """Not exact (attends to unwritten positions): isolates what the mask costs."""

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        return None


class ColumnCache(SlotLayerCache):
    """Every row at the same position (true in this test): a slice update instead of a scatter."""

    def update_and_fetch(self, keys, values):
        self.keys = mx.slice_update(self.keys, keys, self.positions[:1], axes=(2,))
        self.values = mx.slice_update(self.values, values, self.positions[:1], axes=(2,))
        return self.keys, self.values


def slot_step(model, cache_class):
    def step(tokens, positions, arrays):
        half = len(arrays) // 2
        caches = [cache_class(k, v, positions) for k, v in zip(arrays[:half], arrays[half:])]
        logits = model(tokens[:, None], cache=caches)[:, -1, :]
        return logits, [c.keys for c in caches] + [c.values for c in caches]
    return step


def time_steps(run, steps: int) -> dict:
    total, host = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        pending = run()
        mx.async_eval(pending)
        t1 = time.perf_counter()
        mx.eval(pending)
        t2 = time.perf_counter()
        if i >= 3:
            host.append(t1 - t0)
            total.append(t2 - t0)
    return {"step_ms": 1000 * statistics.median(total), "host_ms": 1000 * statistics.median(host)}


def engine_sections(model, tokenizer, rows: int, cache: int, steps: int) -> dict:
    """The compiled engine's step() with its parts timed: what the host does, and where it waits."""
    from worker.engines import compiled
    from worker.engines.base import SequenceSpec

    engine = compiled.CompiledEngine(model, tokenizer, max_num_seqs=rows, prefill_batch_size=64)
    engine.warm_up(cache + steps + 16, slots=[rows])
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            times.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return wrapper

    engine._decode = timed("compiled_call", engine._decode)
    engine._sample = timed("sample_graph", engine._sample)
    engine._collect = timed("collect_incl_wait", engine._collect)
    engine._fit = timed("fit", engine._fit)
    real_async = compiled.mx.async_eval
    compiled.mx.async_eval = timed("async_eval", real_async)
    vocab = engine.vocab_size
    engine.add([SequenceSpec(uid=f"r{i}", prompt_token_ids=[(i * 31 + k) % (vocab - 5) + 3 for k in range(cache)],
                             max_tokens=steps + 16) for i in range(rows)])
    started = set()
    while len(started) < rows:
        started.update(e.uid for e in engine.step())
    for _ in range(3):
        engine.step()
    times.clear()
    total = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        total.append(time.perf_counter() - t)
    compiled.mx.async_eval = real_async
    out = {name: 1000 * statistics.median(v) for name, v in times.items()}
    out["step"] = 1000 * statistics.median(total)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", default="256", help="comma-separated batch sizes")
    parser.add_argument("--cache", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        results[rows] = variants_at(model, tokenizer, rows, args.cache, args.steps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


def variants_at(model, tokenizer, rows: int, cache: int, steps: int) -> dict:
    layout = KVLayout.of(model)
    results: dict = {}
    print(f"== {rows} rows, {cache}-token cache", flush=True)

    def greedy(logits):
        return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).astype(mx.uint32)

    # mlx-lm's BatchKVCache, eager: the graph BatchGenerator builds every step.
    batch = [BatchKVCache([0] * rows) for _ in model.layers]
    model(mx.zeros((rows, cache), mx.int32), cache=batch)
    mx.eval([c.state for c in batch])
    state = {"tokens": mx.zeros((rows,), mx.uint32)}

    def batch_kv():
        logits = model(state["tokens"][:, None], cache=batch)[:, -1, :]
        state["tokens"] = greedy(logits)
        return [state["tokens"]] + [c.state[0] for c in batch] + [c.state[1] for c in batch]

    t = time.perf_counter()
    results["batch_kv_cache_eager"] = time_steps(batch_kv, steps)
    print("batch_kv_cache_eager", results["batch_kv_cache_eager"], f"({time.perf_counter() - t:.1f} s)", flush=True)

    variants = {
        "slot_eager": (slot_step(model, SlotLayerCache), None),
        "slot_compiled_weights_as_inputs": (slot_step(model, SlotLayerCache), [model]),
        "slot_compiled_weights_as_constants": (slot_step(model, SlotLayerCache), "constants"),
        "slot_compiled_no_mask": (slot_step(model, NoMaskCache), [model]),
        "slot_compiled_slice_update": (slot_step(model, ColumnCache), [model]),
    }
    for name, (fn, inputs) in variants.items():
        if inputs is None:
            step = fn
        elif inputs == "constants":
            step = mx.compile(fn)
        else:
            step = mx.compile(fn, inputs=inputs)
        buffers = SlotBuffers.allocate(layout, rows, 256)
        mx.eval(buffers.arrays())
        box = {"tokens": mx.zeros((rows,), mx.uint32), "arrays": buffers.arrays()}
        positions = mx.full((rows,), cache, mx.int32)

        def run(step=step, box=box, positions=positions):
            logits, arrays = step(box["tokens"], positions, box["arrays"])
            box["tokens"], box["arrays"] = greedy(logits), arrays
            return [box["tokens"]] + arrays

        t = time.perf_counter()
        first = run()
        mx.eval(first)
        compile_s = time.perf_counter() - t
        results[name] = {**time_steps(run, steps), "first_call_s": compile_s}
        print(name, results[name], flush=True)
    results["engine_sections"] = engine_sections(model, tokenizer, rows, cache, steps)
    print("engine_sections", results["engine_sections"], flush=True)
    return results


if __name__ == "__main__":
    main()
