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
    """Load the files into the model: mlx checks every name and shape before it changes anything."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise WeightsError(f"the model refused the version: {exc}") from None
    mx.eval(model.parameters())
