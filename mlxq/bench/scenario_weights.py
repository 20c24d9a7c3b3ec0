"""Scenario `weights`: the same checkpoint in each weight format a worker could serve it in, on this
device (worker/weight_prep.py): a decode step at each of --weights-rows rows and a prefill of
--weights-prefill tokens, timed on the bare model (mlx-lm caches, no engine), for each variant of
--weights-variants:

- as-loaded: what mlx-lm loads (half-precision tensors, quantized layers as the checkpoint has them);
- upcast: half-precision floating tensors (weights, norms, quantization scales and biases) in float32;
- dequantized: quantized layers made dense, in the checkpoint's precision;
- upcast-dequantized: both;
- worker: what a worker does on this device (MLXQ_UPCAST, MLXQ_KEEP_QUANTIZED at their defaults).

Each variant is loaded fresh; ratios are against the first variant listed.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from mlxq.bench.config import BenchConfig
from mlxq.bench.workloads import Tokenizer, make_prompts

WEIGHT_VARIANTS = ("as-loaded", "upcast", "dequantized", "upcast-dequantized", "worker")
DECODE_PROMPT_TOKENS = 32  # each row's prompt before the timed decode steps
WARMUP_STEPS = 2


def load_variant(path: str, variant: str) -> tuple[Any, list[str]]:
    """The model at `path` in weight format `variant`, and what was done to it."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    from worker.weight_prep import prepare_weights, quantized_layers

    model, _ = load(path)
    done: list[str] = []
    if variant == "worker":
        done = prepare_weights(model).notes
    if variant in ("upcast", "upcast-dequantized"):
        model.set_dtype(mx.float32, predicate=lambda dtype: dtype in (mx.float16, mx.bfloat16))
        done.append("half-precision tensors upcast to float32")
    if variant in ("dequantized", "upcast-dequantized") and quantized_layers(model):
        dequantize_model(model)
        done.append("quantized layers dequantized")
    mx.eval(model.parameters())
    return model, done


def weights(cfg: BenchConfig, model_path: str, tokenizer: Tokenizer) -> dict[str, Any]:
    import mlx.core as mx

    rows = list(cfg.weights_rows)
    prompts = make_prompts(tokenizer, max(rows), DECODE_PROMPT_TOKENS, seed=cfg.seed, salt="weights")
    long_prompt = make_prompts(tokenizer, 1, cfg.weights_prefill, seed=cfg.seed, salt="weights-prefill")[0]
    out: dict[str, Any] = {"rows": rows, "steps": cfg.weights_steps, "prefill_tokens": len(long_prompt.ids),
                           "device": str(mx.default_device()), "variants": {}}
    for variant in cfg.weights_variants:
        started = time.perf_counter()
        model, done = load_variant(model_path, variant)
        entry: dict[str, Any] = {"load_s": time.perf_counter() - started, "did": done,
                                 "dtypes": _dtypes(model), "decode_step_ms": {}}
        print(f"   {variant}: {', '.join(done) or 'as loaded'}; {entry['dtypes']}", flush=True)
        for n in rows:
            entry["decode_step_ms"][str(n)] = 1000 * _decode_step_s(model, [p.ids for p in prompts[:n]],
                                                                     cfg.weights_steps)
            print(f"     decode step at {n} rows: {entry['decode_step_ms'][str(n)]:.1f} ms", flush=True)
        entry["prefill_ms"] = 1000 * _prefill_s(model, long_prompt.ids)
        print(f"     prefill of {len(long_prompt.ids)} tokens: {entry['prefill_ms']:.0f} ms", flush=True)
        out["variants"][variant] = entry
        del model
        gc.collect()
        mx.clear_cache()
    base = out["variants"].get(cfg.weights_variants[0])
    if base:
        for variant, entry in out["variants"].items():
            entry["decode_speedup"] = {n: base["decode_step_ms"][n] / ms for n, ms in entry["decode_step_ms"].items()}
            entry["prefill_speedup"] = base["prefill_ms"] / entry["prefill_ms"]
    return out


def _dtypes(model: Any) -> dict[str, int]:
    from mlx.utils import tree_flatten

    counts: dict[str, int] = {}
    for _, array in tree_flatten(model.parameters()):
        name = str(array.dtype).removeprefix("mlx.core.")
        counts[name] = counts.get(name, 0) + 1
    return counts


def _decode_step_s(model: Any, prompts: list[tuple[int, ...]], steps: int) -> float:
    """Median seconds of one decode step of len(prompts) rows (equal-length prompts prefilled first)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([list(p) for p in prompts]), cache=cache)
    tokens = mx.argmax(logits[:, -1:, :], axis=-1)
    mx.eval(tokens)
    times = []
    for i in range(WARMUP_STEPS + steps):
        started = time.perf_counter()
        tokens = mx.argmax(model(tokens, cache=cache)[:, -1:, :], axis=-1)
        mx.eval(tokens)
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _prefill_s(model: Any, prompt: tuple[int, ...]) -> float:
    """Seconds of one prefill of `prompt`, after one of the same length: a shorter one can pick other
    kernels (on CUDA a 4-bit 7B shape's first 128-token prefill took 31.6 s building them)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    mx.eval(model(mx.array([list(prompt)]), cache=make_prompt_cache(model)))
    started = time.perf_counter()
    mx.eval(model(mx.array([list(prompt)]), cache=make_prompt_cache(model)))
    return time.perf_counter() - started


def weights_line(s: dict[str, Any]) -> str:
    first = next(iter(s["variants"]), None)
    parts = []
    for variant, entry in s["variants"].items():
        steps = ", ".join(f"{n} rows {ms:,.0f} ms" for n, ms in entry["decode_step_ms"].items())
        ratio = ""
        if variant != first and "decode_speedup" in entry:
            ratio = " (" + ", ".join(f"{x:.1f}x" for x in entry["decode_speedup"].values()) + \
                    f"; prefill {entry['prefill_speedup']:.1f}x)"
        parts.append(f"{variant}: step {steps}, prefill {entry['prefill_ms']:,.0f} ms{ratio}")
    return (f"- weight formats ({s['device']}; decode step median of {s['steps']}, prefill of {s['prefill_tokens']} "
            f"tokens; speedups against {first}): " + "; ".join(parts))
