"""The only platform-specific code in the worker: a fast BLAS and a faster e**x for Linux CPU, direct
kernel launches for CUDA, float32 matrix products in float32 (CUDA, M5-class Macs), Metal memory limits for macOS. Each branch is guarded and unit-tested; nothing Linux-only runs on macOS."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("mlxq.platform")

# Debian/Ubuntu (libopenblas0-pthread), Fedora, then whatever the loader finds by name.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass
class BlasChoice:
    name: str  # what the start-up log line says
    path: Optional[str] = None


_blas_choice: Optional[BlasChoice] = None


def preload_blas(setting: str = "auto", platform: str = sys.platform) -> BlasChoice:
    """Make MLX's CPU backend use an optimized BLAS on Linux: the reference BLAS bundled in the
    mlx-cpu wheel is far slower at matmul (docs/design-notes.md, Linux CPU).

    Loading the library RTLD_GLOBAL before `mlx.core` is first imported makes its BLAS symbols
    win over the bundled ones when libmlx is bound. It must run before any `import mlx`.
    """
    global _blas_choice
    if _blas_choice is not None:
        return _blas_choice
    if platform != "linux":
        _blas_choice = BlasChoice("platform default (Accelerate on macOS)" if platform == "darwin" else "platform default")
        return _blas_choice
    if setting == "off":
        _blas_choice = BlasChoice("bundled reference BLAS (MLXQ_BLAS=off)")
        return _blas_choice
    if "mlx.core" in sys.modules:
        _blas_choice = BlasChoice("bundled reference BLAS (mlx was imported before mlxq could preload one)")
        log.warning("mlx.core was imported before worker: cannot switch MLX to an optimized BLAS")
        return _blas_choice
    candidates = [setting] if setting != "auto" else [p for p in OPENBLAS_CANDIDATES if os.path.exists(p)]
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            if setting != "auto":
                raise RuntimeError(f"MLXQ_BLAS={setting}: cannot load it: {exc}") from exc
            continue
        _blas_choice = BlasChoice(f"OpenBLAS ({path})" if "blas" in path.lower() else path, path)
        return _blas_choice
    _blas_choice = BlasChoice(
        "bundled reference BLAS: slow; install OpenBLAS (apt-get install libopenblas0-pthread) "
        "or set MLXQ_BLAS to a BLAS library path"
    )
    return _blas_choice


def launch_cuda_kernels_directly(environ: MutableMapping[str, str] = os.environ, platform: str = sys.platform) -> bool:
    """On Linux, where MLX's CUDA backend runs, have it launch kernels directly rather than through
    CUDA graphs, unless MLX_USE_CUDA_GRAPHS is set: a decode step's graphs change shape whenever a
    sequence joins, and building them cost more than they saved (docs/engine.md#cuda-graphs).
    It must run before MLX first evaluates anything. Returns whether it set the variable."""
    if platform != "linux" or "MLX_USE_CUDA_GRAPHS" in environ:
        return False
    environ["MLX_USE_CUDA_GRAPHS"] = "0"
    return True


def keep_float32_matmuls_in_float32(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Have MLX run float32 matrix products in float32 (MLX_ENABLE_TF32=0) unless MLX_ENABLE_TF32
    is set. MLX's default lets CUDA (and M5-class Macs) run them in TF32, whose roundings
    depend on the batch's shape: on the H200 the real model's float32 copy then gave next-token
    log-probabilities 0.038 apart batched and alone, so the compiled engine refused it, and
    greedy tokens under speculative decoding could differ from those without
    (docs/engine.md#the-probe). Half-precision weights do not use TF32 and are not affected. It must
    run before MLX first multiplies matrices. Returns whether it set the variable."""
    if "MLX_ENABLE_TF32" in environ:
        return False
    environ["MLX_ENABLE_TF32"] = "0"
    return True


def exp_through_power(device_is_cpu: bool, platform: str = sys.platform) -> bool:
    """Whether to compute e**x as `power(e, x)` rather than `exp(x)`. On Linux, MLX's CPU backend
    computes `exp` one value at a time with its own polynomial, while `power` calls the C library,
    which took a third of the time on these hosts (docs/performance.md#sampled-rows-on-a-linux-cpu).
    Macs (Accelerate's vector `exp`), Metal and CUDA keep `exp`."""
    return platform == "linux" and device_is_cpu


def float32_matmuls_round(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether MLX may run float32 matrix products in TF32 (MLX_ENABLE_TF32 unset or not 0)."""
    return environ.get("MLX_ENABLE_TF32", "1").strip() != "0"


def limit_blas_threads(threads: int, choice: BlasChoice) -> Optional[str]:
    """Cap the threads of the BLAS that `preload_blas` loaded (OpenBLAS starts one per core).
    Several workers on one CPU host each want a share of the cores: with all of them per worker,
    their BLAS threads contend. Returns what it set; None where mlxq loaded no BLAS (macOS, MLX's
    bundled one), which it leaves alone."""
    if choice.path is None:
        return None
    set_threads = getattr(ctypes.CDLL(choice.path, mode=ctypes.RTLD_GLOBAL), "openblas_set_num_threads", None)
    if set_threads is None:
        raise RuntimeError(f"MLXQ_BLAS_THREADS={threads}: {choice.path} has no openblas_set_num_threads")
    set_threads(ctypes.c_int(threads))
    return f"{threads} BLAS thread{'s' if threads != 1 else ''}"


def apply_metal_limits(wired_limit_mb: Optional[int], cache_limit_mb: Optional[int]) -> list[str]:
    """Apply Metal memory limits when running on a Mac GPU; a no-op elsewhere. Returns what it set."""
    import mlx.core as mx

    if sys.platform != "darwin" or not mx.metal.is_available():
        return []
    applied = []
    if wired_limit_mb is not None:
        mx.set_wired_limit(wired_limit_mb * 1024 * 1024)
        applied.append(f"wired limit {wired_limit_mb} MB")
    if cache_limit_mb is not None:
        mx.set_cache_limit(cache_limit_mb * 1024 * 1024)
        applied.append(f"cache limit {cache_limit_mb} MB")
    return applied


def device_description() -> str:
    import mlx.core as mx

    device = mx.default_device()
    return f"mlx {mx.__version__} on {device}"
