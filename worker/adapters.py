"""LoRA adapters a worker serves (docs/rl.md, "Adapters"): where they come from and how one is read.

An adapter is a directory as `mlx_lm.lora` writes it: `adapter_config.json` (`fine_tune_type`
"lora", `lora_parameters` with its `scale`) and `adapters.safetensors`, whose tensors are
`<module path>.lora_a` (input_dims x rank) and `<module path>.lora_b` (rank x output_dims) of the
linear layers it adapts. The tensors say which layers and which rank; the config's `scale`
multiplies the product, as mlx-lm's LoRALinear does. DoRA, full fine-tunes, quantized adapter
packs and adapters of embedding or mixture-of-experts layers are refused, naming `adapter`.

Names resolve, in this order, to an adapter published through Redis (`Client.publish_adapter`,
fetched by the control plane into a folder of the worker's own) or to the subdirectory of that
name under `MLXQ_ADAPTER_DIR`. The catalog knows only where an adapter is; reading it into
memory, and keeping it resident, is the engine's (worker/engines/lora.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from worker.tensor_files import TensorFileError, check_tensor_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._:/-]{1,256}$")

__all__ = ["AdapterCatalog", "AdapterError", "AdapterSource", "LoraWeights", "read_adapter"]


class AdapterError(ValueError):
    """An adapter this worker cannot serve; the message starts with `adapter:` and says why."""


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter's files are, and which publication of its name they are (a name published
    again is a new adapter: nothing computed under the old one is reused)."""

    name: str
    directory: Path
    generation: int = 0

    @property
    def key(self) -> str:
        return f"{self.name}@{self.generation}"


@dataclass(frozen=True)
class LoraWeights:
    """An adapter read into memory: per adapted module path, A (input_dims x rank) and B (rank x
    output_dims), float32 numpy arrays, and the scale of their product."""

    source: AdapterSource
    scale: float
    layers: dict[str, tuple[Any, Any]]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) + int(b.nbytes) for a, b in self.layers.values())


def check_name(name: str) -> None:
    if not NAME_PATTERN.match(name) or any(part in ("", ".", "..") for part in name.split("/")):
        raise AdapterError(f"adapter: {name!r} is not an adapter name (letters, digits, . _ : / -, no empty, "
                           "'.' or '..' path parts)")


class AdapterCatalog:
    """The adapters a worker can serve, by name: published ones (registered by the control plane)
    and the subdirectories of `directory`."""

    def __init__(self, directory: Optional[str | Path] = None) -> None:
        self.directory = Path(directory).resolve() if directory else None
        self._published: dict[str, AdapterSource] = {}
        self._generation = 0

    def register(self, name: str, directory: Path) -> AdapterSource:
        """A published adapter is ready in `directory`: it replaces any adapter of that name."""
        check_name(name)
        self._generation += 1
        source = AdapterSource(name, Path(directory), self._generation)
        self._published[name] = source
        return source

    def resolve(self, name: str) -> AdapterSource:
        """Where adapter `name` is; AdapterError naming `adapter` when this worker has none of that name."""
        check_name(name)
        published = self._published.get(name)
        if published is not None:
            return published
        if self.directory is not None:
            candidate = (self.directory / name).resolve()
            if candidate.is_relative_to(self.directory) and (candidate / CONFIG_FILE).is_file():
                return AdapterSource(name, candidate)
        where = (f"no subdirectory {name!r} with an {CONFIG_FILE} under MLXQ_ADAPTER_DIR ({self.directory})"
                 if self.directory is not None else "MLXQ_ADAPTER_DIR is not set")
        raise AdapterError(f"adapter: this worker has no adapter {name!r}: it was not published for this model "
                           f"and {where}")

    def names(self) -> list[str]:
        found = set(self._published)
        if self.directory is not None and self.directory.is_dir():
            found.update(p.parent.relative_to(self.directory).as_posix()
                         for p in self.directory.rglob(CONFIG_FILE))
        return sorted(found)


def read_adapter(source: AdapterSource, modules: dict[str, Any]) -> LoraWeights:
    """Read and check an adapter against the model's modules (`dict(model.named_modules())`):
    every tensor a `lora_a` / `lora_b` pair of a linear layer the model has, shapes matching it."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    name = source.name
    config = _read_config(source)
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"adapter: {name!r} is a {kind!r} fine-tune; only LoRA adapters are served")
    parameters = config.get("lora_parameters")
    scale = parameters.get("scale") if isinstance(parameters, dict) else None
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise AdapterError(f"adapter: {name!r}: {CONFIG_FILE} has no lora_parameters.scale")
    if not math.isfinite(scale):
        raise AdapterError(f"adapter: {name!r}: lora_parameters.scale is {scale}, not a finite number")
    path = source.directory / WEIGHTS_FILE
    try:
        check_tensor_file(path)  # byte ranges and finite values, before mlx reads a byte of it
        tensors = mx.load(str(path))
    except TensorFileError as exc:
        raise AdapterError(f"adapter: {name!r}: {exc}") from None
    except Exception as exc:  # mlx raises RuntimeError on a file it cannot read
        raise AdapterError(f"adapter: {name!r}: cannot read {WEIGHTS_FILE} ({exc})") from None
    assert isinstance(tensors, dict)
    pairs: dict[str, dict[str, Any]] = {}
    for tensor_name, array in tensors.items():
        module_path, _, leaf = tensor_name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterError(f"adapter: {name!r}: tensor {tensor_name!r} is not a LoRA matrix (lora_a / lora_b); "
                               "DoRA and quantized adapters are not served")
        pairs.setdefault(module_path, {})[leaf] = array
    if not pairs:
        raise AdapterError(f"adapter: {name!r}: {WEIGHTS_FILE} holds no LoRA matrices")
    layers: dict[str, tuple[Any, Any]] = {}
    for module_path, pair in sorted(pairs.items()):
        module = modules.get(module_path)
        if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            what = "no such module" if module is None else f"a {type(module).__name__}, not a linear layer"
            raise AdapterError(f"adapter: {name!r}: {module_path!r} is {what} in this model")
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"adapter: {name!r}: {module_path!r} has only {', '.join(pair)}")
        a, b = pair["lora_a"], pair["lora_b"]
        inputs, outputs = linear_dims(module)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != inputs or b.shape[1] != outputs or a.shape[1] != b.shape[0]:
            raise AdapterError(f"adapter: {name!r}: {module_path!r} has lora_a {tuple(a.shape)} and lora_b "
                               f"{tuple(b.shape)}; the layer takes {inputs} inputs to {outputs} outputs")
        # Kept on the host in float32: the engine stacks them there (worker/engines/lora.py).
        try:
            host_a, host_b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        except Exception as exc:  # the file changed after it was checked
            raise AdapterError(f"adapter: {name!r}: cannot read {module_path!r} ({exc})") from None
        largest = float(np.abs(host_b).max(initial=0.0)) * abs(float(scale))
        limit = float(mx.finfo(module_dtype(module)).max)
        if not np.isfinite(host_a).all() or not np.isfinite(host_b).all() or not largest <= limit:
            raise AdapterError(f"adapter: {name!r}: {module_path!r}: lora_b times lora_parameters.scale ({scale}) "
                               f"is not finite in the model's {module_dtype(module)}")
        layers[module_path] = (host_a, host_b)
    return LoraWeights(source, float(scale), layers)


def module_dtype(module: Any) -> Any:
    """The dtype a linear layer computes in (a quantized one's: its scales')."""
    return module["scales"].dtype if "scales" in module else module.weight.dtype


def linear_dims(module: Any) -> tuple[int, int]:
    """(input_dims, output_dims) of a linear layer, quantized or not."""
    outputs, inputs = module.weight.shape
    bits = getattr(module, "bits", None)
    if "scales" in module and bits:
        inputs = inputs * 32 // bits
    return int(inputs), int(outputs)


def _read_config(source: AdapterSource) -> dict[str, Any]:
    path = source.directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter: {source.name!r}: cannot read {CONFIG_FILE} ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter: {source.name!r}: {CONFIG_FILE} is not a JSON object")
    return config
