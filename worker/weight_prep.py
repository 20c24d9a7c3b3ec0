"""The served weights' formats per platform, settled once when the model is loaded.

- CPU: half-precision floating tensors (bfloat16 and float16 weights, norms, quantization scales
  and biases) become float32. MLX's CPU backend has no fast half-precision arithmetic on x86:
  a real 4-bit checkpoint with float16 scales decoded ~35x slower than with float32 ones
  (docs/performance.md, "Weight formats"). float32 holds every half-precision value exactly.
- CPU and CUDA: quantized layers are dequantized when memory allows. MLX's quantized matmul costs
  about rows x one row's time on the CPU and is slow on CUDA at 8 rows and more; a dense layer is
  many times faster there. The dequantized weight is exactly what the quantized kernels compute
  with (w * scale + bias).
- Metal: nothing changes: its quantized kernels are fast and its half-precision arithmetic native.

Each step can be turned off: MLXQ_UPCAST=0 keeps half-precision tensors, MLXQ_KEEP_QUANTIZED=1
keeps quantized layers (docs/configuration.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

log = logging.getLogger("mlxq.worker")

PLATFORMS = ("cpu", "cuda", "metal")
# Dequantizing may take at most this share of the memory free at load: the rest is the KV cache's.
DEQUANTIZE_MEMORY_SHARE = 0.5


@dataclass
class WeightReport:
    """What `prepare_weights` did: whether it upcast and dequantized, and each step in words."""

    upcast: bool = False
    dequantized: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WeightPlan:
    upcast: bool  # half-precision floating tensors -> float32
    dequantize: bool  # quantized layers -> dense (float32 after an upcast, else their scales' dtype)


def current_platform() -> str:
    """Where MLX computes: "cpu", "cuda" or "metal"."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def plan_weights(platform: str, upcast: bool = True, keep_quantized: bool = False) -> WeightPlan:
    """What loading does to the weights on `platform` under the two settings."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r} ({', '.join(PLATFORMS)})")
    return WeightPlan(upcast=upcast and platform == "cpu", dequantize=not keep_quantized and platform != "metal")


def prepare_weights(model: Any, platform: Optional[str] = None, *, upcast: bool = True,
                    keep_quantized: bool = False, free_bytes: Optional[int] = None) -> WeightReport:
    """Apply the platform's plan to a loaded model, in place, and say what it did.
    `free_bytes`: the memory the dequantized weights may come out of (default: what is free now)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    platform = platform or current_platform()
    plan = plan_weights(platform, upcast, keep_quantized)
    report = WeightReport()
    done = report.notes
    if plan.upcast:
        halves = [(name, a) for name, a in tree_flatten(model.parameters()) if a.dtype in (mx.float16, mx.bfloat16)]
        if halves:
            kinds = "/".join(sorted({str(a.dtype).removeprefix("mlx.core.") for _, a in halves}))
            model.set_dtype(mx.float32, predicate=lambda dtype: dtype in (mx.float16, mx.bfloat16))
            report.upcast = True
            model.mlxq_upcast = True  # weight versions may come in half precision (worker/engines/weight_swap.py)
            done.append(f"{len(halves)} {kinds} tensors upcast to float32 "
                        f"(+{sum(a.nbytes for _, a in halves) / 2**20:.0f} MiB; MLXQ_UPCAST=0 keeps them)")
    quantized = quantized_layers(model)
    if quantized and plan.dequantize:
        extra = sum(_dense_bytes(m) - _quantized_bytes(m) for _, m in quantized)
        free = available_memory_bytes(platform) if free_bytes is None else free_bytes
        if extra <= free * DEQUANTIZE_MEMORY_SHARE:
            from mlx_lm.utils import dequantize_model

            dequantize_model(model)
            report.dequantized = True
            done.append(f"{len(quantized)} quantized layers dequantized (+{extra / 2**20:.0f} MiB; "
                        "MLXQ_KEEP_QUANTIZED=1 keeps them)")
        else:
            done.append(f"{len(quantized)} quantized layers kept quantized: dequantizing needs {extra / 2**30:.1f} GiB, "
                        f"more than {DEQUANTIZE_MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB free")
    elif quantized:
        done.append(f"{len(quantized)} quantized layers kept quantized"
                    + (" (MLXQ_KEEP_QUANTIZED)" if keep_quantized else f" ({platform})"))
    if report.upcast or report.dequantized:
        mx.eval(model.parameters())
    return report


def quantized_layers(model: Any) -> list[tuple[str, Any]]:
    import mlx.nn as nn

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def _quantized_bytes(module: Any) -> int:
    return sum(int(getattr(module, k).nbytes) for k in ("weight", "scales", "biases") if k in module)


def _dense_bytes(module: Any) -> int:
    """The dequantized weight's bytes: its values (32 / bits per packed word) in the scales' dtype."""
    return int(module.weight.size * (32 // module.bits) * module.scales.dtype.size)


def available_memory_bytes(platform: str) -> int:
    """Memory free for new arrays: the host's available RAM on the CPU, the device's free memory on a GPU."""
    if platform != "cpu":
        import mlx.core as mx

        info = mx.device_info()
        if "free_memory" in info:  # CUDA (MLX reads it from NVML)
            return int(info["free_memory"])
        total = int(info.get("memory_size", info.get("total_memory", 0)))  # Metal: the unified memory
        if total:
            return max(0, total - int(mx.get_active_memory()))
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
