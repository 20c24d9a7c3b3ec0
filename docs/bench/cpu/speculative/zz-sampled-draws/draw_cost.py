"""What a seeded row's draw costs on this CPU, before and after 3fc02cd, over R rows of the real
model's 49,152 logits (R = 8: a decode step at 8 rows; 40: a verification pass of 8 rows x 5):
  before: the log-softmax, then the inverse CDF with mx.exp;
  after:  the inverse CDF of the logits, with e**x through mx.power on a Linux CPU.
Also e**x alone both ways over 40 x 49,152 values. Run from the checkout's root:
  .venv/bin/python docs/bench/cpu/speculative/zz-sampled-draws/draw_cost.py
"""
import worker  # noqa: F401  (OpenBLAS before MLX)

import math
import time

import mlx.core as mx

from worker.engines import sampling
from worker.engines.base import SamplingParams


def median_ms(fn, n=20):
    mx.eval(fn())
    times = []
    for _ in range(n):
        started = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - started)
    return sorted(times)[n // 2] * 1000


def main():
    x = mx.random.normal((40, 49152), key=mx.random.key(0)) * 4
    mx.eval(x)
    print(f"e**x over 40 x 49,152: mx.exp {median_ms(lambda: mx.exp(x)):.1f} ms, "
          f"mx.power(e, x) {median_ms(lambda: mx.power(math.e, x)):.1f} ms")
    through_power = sampling.exp_through_power
    for rows in (8, 40):
        logits = x[:rows]
        params = [SamplingParams(temperature=0.7, seed=i) for i in range(rows)]
        keys = [sampling.mix_seed(i, 0, 3) for i in range(rows)]
        sampling.exp_through_power = lambda cpu: False
        before = median_ms(lambda: sampling.draw_with_keys(
            logits - mx.logsumexp(logits, axis=-1, keepdims=True), params, keys))
        sampling.exp_through_power = through_power
        after = median_ms(lambda: sampling.draw_with_keys(logits, params, keys))
        same = sampling.draw_with_keys(logits, params, keys).tolist() == sampling.draw_with_keys(
            logits - mx.logsumexp(logits, axis=-1, keepdims=True), params, keys).tolist()
        print(f"{rows} seeded rows: before {before:.1f} ms, after {after:.1f} ms; the same tokens: {same}")


if __name__ == "__main__":
    main()
