"""Swapping a weight version into a loaded model, all or nothing (worker/weights.py fetches and
checks the version's files first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


ParameterSpec = dict[str, tuple[str, tuple[int, ...]]]  # parameter name -> (dtype, shape)


# A model upcast at load (worker/weight_prep.py) takes a float32 parameter in any of these dtypes, as
# the checkpoint had it (a trainer publishes what it trains): swap_into casts it, exactly.
UPCAST_ACCEPTS = "float32|bfloat16|float16"


def parameter_spec(model: Any) -> ParameterSpec:
    """What a version must hold for this model: each parameter, in MLX's naming, with its dtype
    (several, `|`-separated, where the model takes any of them) and shape."""
    from mlx.utils import tree_flatten

    upcast = bool(getattr(model, "mlxq_upcast", False))
    spec = {}
    for name, array in tree_flatten(model.parameters()):
        dtype = str(array.dtype).removeprefix("mlx.core.")
        spec[name] = (UPCAST_ACCEPTS if upcast and dtype == "float32" else dtype, tuple(array.shape))
    return spec


class WeightsError(ValueError):
    """A version that cannot be swapped in; the message says which file or parameter and why."""


def swap_into(model: Any, files: list[Path]) -> None:
    """Load the files into the model, all or nothing: every tensor is read and checked finite before
    the model takes any (mlx checks every name and shape before it changes anything). Both versions
    are in memory for that moment. The weights thread checked the files already; this read catches a
    file that changed since (mlx raises RuntimeError on one cut short)."""
    import mlx.core as mx

    from mlx.utils import tree_flatten

    try:
        weights: dict[str, Any] = {}
        for path in files:
            weights.update(mx.load(str(path)))
        served = dict(tree_flatten(model.parameters()))
        for name, array in weights.items():  # a half-precision version of an upcast model: cast up
            if name in served and array.dtype != served[name].dtype and mx.issubdtype(array.dtype, mx.floating):
                weights[name] = array.astype(served[name].dtype)
        floating = [name for name, array in weights.items() if mx.issubdtype(array.dtype, mx.floating)]
        finite = [mx.all(mx.isfinite(weights[name])) for name in floating]
        mx.eval(list(weights.values()), finite)
    except Exception as exc:
        raise WeightsError(f"could not read the version's files: {type(exc).__name__}: {exc}") from None
    bad = [name for name, ok in zip(floating, finite) if not ok.item()]
    if bad:
        raise WeightsError(f"parameter {bad[0]!r} holds values that are not finite (NaN or infinite)"
                           + (f", and {len(bad) - 1} more" if len(bad) > 1 else ""))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except Exception as exc:
        raise WeightsError(f"the model refused the version: {exc}") from None
    mx.eval(model.parameters())
