"""What a lone joiner's prefill costs the host, piece by piece: one 128-token prompt into a slot of
48 x 512 slot buffers, as the compiled engine does it (gather, model call, scatter, eval), and its
variants: with the last token's logits, with mlx-lm's own KVCache, and compiled.

`python docs/bench/h200/dec02b/prefill_parts.py --model DIR`
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import worker  # noqa: F401
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from worker.engines.slot_cache import KVLayout, SlotBuffers


def timeit(label: str, fn: Callable[[], Any], repeats: int = 20) -> None:
    for _ in range(3):
        fn()
    built, total = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        middle = time.perf_counter()
        mx.eval(out)
        ended = time.perf_counter()
        built.append(middle - started)
        total.append(ended - started)
    print(f"{label:55s} build {statistics.median(built) * 1e3:6.2f} ms  total {statistics.median(total) * 1e3:6.2f} ms",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model, _ = load(args.model)
    layout = KVLayout.of(model)
    buffers = SlotBuffers.allocate(layout, 48, 512)
    mx.eval(buffers.arrays())
    n = args.tokens - 1
    tokens = mx.array([[(7 * i) % 1000 + 3 for i in range(n)]], dtype=mx.int32)
    with_last = mx.array([[(7 * i) % 1000 + 3 for i in range(n + 1)]], dtype=mx.int32)

    def gather_scatter() -> Any:
        part = buffers.gather([5], n)
        buffers.scatter([5], part)
        return buffers.arrays()

    def slot_prefill(toks: mx.array, logits_out: bool = False) -> Callable[[], Any]:
        def run() -> Any:
            part = buffers.gather([5], toks.shape[1])
            caches = part.layer_caches(mx.array([0], dtype=mx.int32), layout.grouped_mask)
            logits = model(toks, cache=caches)
            part.absorb(caches)
            buffers.scatter([5], part)
            return [*buffers.arrays(), logits[:, -1, :]] if logits_out else buffers.arrays()
        return run

    def own_cache() -> Any:
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        return [c.state for c in cache]

    def own_cache_into_slot() -> Any:
        cache = make_prompt_cache(model)
        logits = model(with_last, cache=cache)
        buffers.write_prefix([5], cache, with_last.shape[1])
        return [*buffers.arrays(), logits[:, -1, :]]

    def step_fn(toks: mx.array, positions: mx.array, arrays: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
        half = len(arrays) // 2
        part = SlotBuffers(arrays[:half], arrays[half:])
        caches = part.layer_caches(positions, layout.grouped_mask)
        logits = model(toks, cache=caches)[:, -1, :]
        part.absorb(caches)
        return logits, part.arrays()

    compiled = mx.compile(step_fn, inputs=[model])

    def compiled_prefill() -> Any:
        part = buffers.gather([5], with_last.shape[1])
        logits, arrays = compiled(with_last, mx.array([0], dtype=mx.int32), part.arrays())
        half = len(arrays) // 2
        buffers.scatter([5], SlotBuffers(arrays[:half], arrays[half:]))
        return [*buffers.arrays(), logits]

    timeit("gather + scatter only", gather_scatter)
    timeit(f"slot prefill, {n} tokens (the engine's)", slot_prefill(tokens))
    timeit(f"slot prefill, {n + 1} tokens, last logits", slot_prefill(with_last, True))
    timeit(f"mlx-lm KVCache prefill, {n} tokens", own_cache)
    timeit(f"mlx-lm KVCache prefill, {n + 1} tokens, into the slot, last logits", own_cache_into_slot)
    timeit(f"compiled slot prefill, {n + 1} tokens, last logits", compiled_prefill)


if __name__ == "__main__":
    main()
