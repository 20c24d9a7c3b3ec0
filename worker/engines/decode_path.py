"""Which engine decodes a model: mlxq's compiled engine (worker/engines/compiled.py) where it is
exact, mlx-lm's BatchGenerator (worker/engines/text.py) everywhere else.

The compiled engine gives each layer a slot cache instead of mlx-lm's own (worker/engines/
slot_cache.py). That is exact for a model whose every layer keeps a plain `KVCache` and whose
attention uses the cache only through `offset`, `update_and_fetch` and the mask it makes: the
architectures in COVERED, read and tested here. Sliding-window (`RotatingKVCache`), recurrent
(`ArraysCache`, SSM) and hybrid caches, and architectures not in COVERED, take mlx-lm's path.
A covered model is also probed once: two prompts of different lengths through slot buffers as
one batch must give the next-token log-probabilities mlx-lm gives each alone (in float32 within
1e-3 for every token; in half precision and on CUDA as distributions: docs/engine.md#the-probe).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from worker.engines.slot_cache import KVLayout, SlotBuffers
from worker.platform import float32_matmuls_round
from worker.weight_prep import current_platform

log = logging.getLogger("mlxq.engine")

# mlx-lm `model_type`s whose attention layers were read against the slot cache (mistral loads
# through llama.py); each is tested as a tiny random model.
COVERED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")

DECODE_SETTINGS = ("auto", "compiled", "batch-generator")

# float32: the largest difference of any token's next-token log-probability (sums in another order
# stay far below it). Half precision: the total variation distance of the two distributions, since a
# GPU's kernels for another batch shape round every logit another way; a wrong mask or position moves
# the probable tokens and lands far above it (measurements: docs/engine.md#the-probe).
PROBE_TOLERANCE = {mx.float32: 1e-3}
PROBE_TOLERANCE_LOW_PRECISION = 0.1
PROBE_PROMPTS = ([11, 27, 5, 201, 42], [7, 19, 88, 3, 250, 61, 9, 14, 120])


@dataclass(frozen=True)
class DecodePath:
    name: str  # "compiled" | "batch-generator"
    reason: str


def choose_decode_path(model: Any, setting: str = "auto") -> DecodePath:
    """The engine for `model` under MLXQ_DECODE=`setting` (auto | compiled | batch-generator).
    `compiled` on a model the compiled engine cannot run exactly raises ValueError with the reason."""
    if setting not in DECODE_SETTINGS:
        raise ValueError(f"MLXQ_DECODE: unknown decode path {setting!r} ({' | '.join(DECODE_SETTINGS)})")
    if setting == "batch-generator":
        return DecodePath("batch-generator", "MLXQ_DECODE=batch-generator")
    reason = compiled_unsupported_reason(model)
    if reason is None:
        return DecodePath("compiled", f"{_model_type(model)}: plain KV caches; the probe matched mlx-lm")
    if setting == "compiled":
        raise ValueError(f"MLXQ_DECODE=compiled: this model cannot use the compiled decode path: {reason}")
    return DecodePath("batch-generator", reason)


def compiled_unsupported_reason(model: Any) -> Optional[str]:
    """Why the compiled engine would not be exact for `model`; None if it is."""
    try:
        cache = make_prompt_cache(model)
    except Exception as exc:
        return f"its caches could not be made ({type(exc).__name__}: {exc})"
    others = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if others or not cache:
        kinds = ", ".join(others) or "no"
        return f"its layers keep {kinds} caches, not only plain KVCache (a sliding window, recurrent state or both)"
    model_type = _model_type(model)
    if model_type not in COVERED:
        return f"architecture {model_type!r} is not one the compiled path covers ({', '.join(COVERED)})"
    return _probe(model)


def _model_type(model: Any) -> Optional[str]:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None)


def _probe(model: Any) -> Optional[str]:
    try:
        batched = _next_token_logprobs_batched(model, PROBE_PROMPTS)
        alone = [_next_token_logprobs_alone(model, prompt) for prompt in PROBE_PROMPTS]
    except Exception as exc:
        return f"the probe failed: {type(exc).__name__}: {exc}"
    worst, measure, tolerance = probe_difference(batched, alone, rounds_below_float32(model, current_platform()))
    log.info("probe: next-token %s %.3g apart from mlx-lm's (tolerance %s)", measure, worst, tolerance)
    if not worst <= tolerance:
        return f"the probe's next-token {measure} are {worst:.3g} apart from mlx-lm's (> {tolerance})"
    return None


def rounds_below_float32(model: Any, platform: str) -> bool:
    """Whether the model's arithmetic rounds below float32: any of its floating-point weights is
    bfloat16 or float16 (its activations are rounded even where its logits come out in float32, as
    with a GGUF file's float32 norms), or it runs on CUDA with float32 matmuls allowed in TF32
    (MLX_ENABLE_TF32, worker/platform.py), which measured 0.038 apart batched against alone on
    the real model (docs/engine.md#the-probe)."""
    from mlx.utils import tree_flatten

    if platform == "cuda" and float32_matmuls_round():
        return True
    return any(v.dtype in (mx.bfloat16, mx.float16) for _, v in tree_flatten(model.parameters()))


def probe_difference(batched: list[mx.array], alone: list[mx.array], half_precision: bool = False
                     ) -> tuple[float, str, float]:
    """(the worst difference over the prompts, what it measures, the tolerance) of next-token
    log-probabilities computed batched in slot buffers against alone, by a model that computes in
    half precision or not."""
    tolerance = None if half_precision else PROBE_TOLERANCE.get(alone[0].dtype)
    if tolerance is not None:
        worst = max(float(mx.where(a == b, 0.0, mx.abs(b - a)).max()) for b, a in zip(batched, alone))  # -inf == -inf
        return worst, "log-probabilities", tolerance
    worst = max(0.5 * float(mx.abs(mx.exp(b.astype(mx.float32)) - mx.exp(a.astype(mx.float32))).sum())
                for b, a in zip(batched, alone))
    return worst, "distribution (total variation)", PROBE_TOLERANCE_LOW_PRECISION


def _next_token_logprobs_alone(model: Any, prompt: list[int]) -> mx.array:
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    logits = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1]
    return logits - mx.logsumexp(logits)


def _next_token_logprobs_batched(model: Any, prompts: tuple[list[int], ...]) -> list[mx.array]:
    """As the compiled engine runs them: every prompt but its last token prefilled into its slot,
    right-padded, then one decode step of both slots at their own positions."""
    layout = KVLayout.of(model)
    width = max(len(p) for p in prompts) - 1
    buffers = SlotBuffers.allocate(layout, len(prompts), width + 8)
    caches = buffers.layer_caches(mx.zeros((len(prompts),), mx.int32), layout.grouped_mask)
    model(mx.array([p[:-1] + [0] * (width - len(p) + 1) for p in prompts]), cache=caches)
    buffers.absorb(caches)
    caches = buffers.layer_caches(mx.array([len(p) - 1 for p in prompts], dtype=mx.int32), layout.grouped_mask)
    logits = model(mx.array([p[-1] for p in prompts])[:, None], cache=caches)[:, -1]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logprobs[i] for i in range(len(prompts))]
