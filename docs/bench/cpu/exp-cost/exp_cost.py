"""What MLX's elementwise ops cost on this x86 CPU, next to a matmul of the same layer: the shapes of
SmolLM2-135M's MLP over 8 prompts of 139 tokens (1112 positions, 1536 intermediate), and the attention
scores of those prompts (8 x 9 heads x 139 x 139). Best of 5, ms. Run from the checkout:
  .venv/bin/python docs/bench/cpu/exp-cost/exp_cost.py
"""
import worker  # noqa: F401  (OpenBLAS before MLX)

import time

import mlx.core as mx
import mlx.nn as nn


def best_ms(f, n=5):
    f()
    best = 1e9
    for _ in range(n):
        started = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


x = mx.random.normal((1112, 1536))
a, w = mx.random.normal((1112, 576)), mx.random.normal((1536, 576))
scores = mx.random.normal((8, 9, 139, 139))
mx.eval(x, a, w, scores)
ops = [("exp", mx.exp), ("tanh", mx.tanh), ("sigmoid", mx.sigmoid), ("erf", mx.erf), ("log1p", mx.log1p),
       ("sqrt", mx.sqrt), ("rsqrt", mx.rsqrt), ("reciprocal", mx.reciprocal), ("floor", mx.floor),
       ("multiply", lambda v: v * v), ("maximum", lambda v: mx.maximum(v, 0)), ("power(2, x)", lambda v: mx.power(2.0, v)),
       ("nn.silu", nn.silu), ("silu, compiled", mx.compile(lambda v: v * mx.sigmoid(v), shapeless=True))]
for name, op in ops:
    print(f"{name:16s} 1112 x 1536     {best_ms(lambda: mx.eval(op(x))):7.2f}")
ms = best_ms(lambda: mx.eval(a @ w.T))
print(f"{'matmul':16s} 1112x576 @ 576x1536 {ms:7.2f}  ({2 * 1112 * 576 * 1536 / ms / 1e6:.0f} GFLOPS)")
print(f"{'softmax':16s} 8 x 9 x 139 x 139 {best_ms(lambda: mx.eval(mx.softmax(scores, axis=-1))):7.2f}")
