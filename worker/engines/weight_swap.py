"""Swapping a weight version into a loaded model, all or nothing (worker/weights.py fetches and
checks the version's files first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


ParameterSpec = dict[str, tuple[str, tuple[int, ...]]]  # parameter name -> (dtype, shape)


def parameter_spec(model: Any) -> ParameterSpec:
    """What a version must hold for this model: each parameter, in MLX's naming, with its dtype and shape."""
    from mlx.utils import tree_flatten

    return {name: (str(array.dtype).removeprefix("mlx.core."), tuple(array.shape))
            for name, array in tree_flatten(model.parameters())}


class WeightsError(ValueError):
    """A version that cannot be swapped in; the message says which file or parameter and why."""


def swap_into(model: Any, files: list[Path]) -> None:
    """Load the files into the model, all or nothing: every tensor is read and checked finite before
    the model takes any (mlx checks every name and shape before it changes anything). Both versions
    are in memory for that moment. The weights thread checked the files already; this read catches a
    file that changed since (mlx raises RuntimeError on one cut short)."""
    import mlx.core as mx

    try:
        weights: dict[str, Any] = {}
        for path in files:
            weights.update(mx.load(str(path)))
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
