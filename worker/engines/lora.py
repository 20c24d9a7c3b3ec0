"""Several LoRA adapters resident at once, applied per row of a batch (docs/rl.md, "Adapters").

Each linear layer some resident adapter adapts computes `y = base(x) + gather_mm(gather_mm(x, A,
index), B, index)`, where A and B stack every resident adapter's matrices for that layer along a
first axis (slot 0 is zeros: the base model's rows; ranks are padded to the largest with zeros,
which changes no product; B carries the adapter's scale) and `index` names each row's slot. Rows
of different adapters, and base rows, therefore run in one model call.

The layers keep their class's behaviour and their parameters' names (a weight version swaps in as
before): each adapted layer's class becomes a subclass whose call adds the term, reading the
stacks and the index from `LoraBank.state`, which the compiled decode step takes as an input
(so a change of stacks or index needs no recompile beyond a new shape). A batch of base rows
only empties that state, and runs the model's own graph.

Adapters are read when a request first names them and stay resident, least recently used first
out, while their bytes stay under the cap; an adapter some sequence decodes with is never evicted
(the cap is exceeded rather than fail it, and the excess goes as soon as those sequences end).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import mlx.core as mx
import numpy as np

from worker.adapters import AdapterCatalog, AdapterError, AdapterSource, LoraWeights, linear_dims, read_adapter

log = logging.getLogger("mlxq.engine")

MIB = 1024 * 1024
_LORA_CLASSES: dict[type, type] = {}


class _Site:
    """The LoRA term of one adapted layer, reading the bank's state at call time (inside a
    compiled step that state holds the step's traced inputs)."""

    __slots__ = ("path", "state")

    def __init__(self, path: str, state: dict[str, Any]) -> None:
        self.path, self.state = path, state

    def __call__(self, x: mx.array, y: mx.array) -> mx.array:
        stacks = self.state.get("stacks")
        pair = stacks.get(self.path) if stacks else None
        if pair is None:
            return y
        index = self.state["index"]
        z = mx.gather_mm(x.astype(pair[0].dtype), pair[0], rhs_indices=index)
        z = mx.gather_mm(z, pair[1], rhs_indices=index)
        return y + z.astype(y.dtype)


def _lora_class(base: type) -> type:
    """`base` with the LoRA term added to its output (one subclass per layer class)."""
    cls = _LORA_CLASSES.get(base)
    if cls is None:
        def __call__(self: Any, x: mx.array) -> mx.array:
            return self._mlxq_lora(x, base.__call__(self, x))

        cls = type(f"Lora{base.__name__}", (base,), {"__call__": __call__})
        _LORA_CLASSES[base] = cls
    return cls


@dataclass
class _Resident:
    weights: LoraWeights
    slot: int
    pins: int = 0  # sequences decoding with it

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes


class LoraBank:
    def __init__(self, model: Any, catalog: AdapterCatalog, max_bytes: int) -> None:
        self.catalog = catalog
        self.max_bytes = max_bytes
        named = getattr(model, "named_modules", None)  # (a stand-in model of a test may have none)
        self._modules: dict[str, Any] = dict(named()) if named is not None else {}
        # The compiled step's input: {"stacks": {path: [A, B]}, "index": (rows,) uint32}, or empty.
        self.state: dict[str, Any] = {}
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._slots: list[Optional[str]] = [None]  # slot -> resident key; slot 0 is the base model
        self._stacks: dict[str, list[mx.array]] = {}
        self._stale = False  # the stacks do not reflect the residents
        self.loads = self.evictions = 0
        for module in self._modules.values():  # layers an earlier bank of this model adapted answer to this one
            site = getattr(module, "_mlxq_lora", None)
            if isinstance(site, _Site):
                site.state = self.state

    # --- residency ------------------------------------------------------------------------
    def check(self, name: str) -> AdapterSource:
        """Make adapter `name` resident (reading it if it is not) and return where it came from;
        AdapterError naming `adapter` if this worker cannot serve it."""
        return self._ensure(name).weights.source

    def pin(self, name: str) -> tuple[str, int]:
        """A sequence starts with adapter `name`: its resident key and slot, held until `unpin`."""
        resident = self._ensure(name)
        resident.pins += 1
        return resident.weights.source.key, resident.slot

    def unpin(self, key: str) -> None:
        resident = self._resident.get(key)
        if resident is not None and resident.pins > 0:
            resident.pins -= 1
        self._trim()

    def unpin_all(self) -> None:
        for resident in self._resident.values():
            resident.pins = 0
        self._trim()

    def publish(self, name: str, directory: Any) -> None:
        """Serve the adapter in `directory` as `name` from now on, once it reads as an adapter of
        this model (AdapterError, naming `adapter`, if not: the name keeps what it had)."""
        read_adapter(AdapterSource(name, directory), self._modules)
        self.catalog.register(name, directory)

    @property
    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self._resident.values())

    def resident_names(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return [r.weights.source.name for r in self._resident.values()]

    def stats(self) -> dict[str, int]:
        return {"adapters_resident": len(self._resident), "adapter_bytes": self.resident_bytes,
                "adapter_loads": self.loads, "adapter_evictions": self.evictions}

    def _ensure(self, name: str) -> _Resident:
        source = self.catalog.resolve(name)
        resident = self._resident.get(source.key)
        if resident is not None:
            self._resident.move_to_end(source.key)
            return resident
        weights = read_adapter(source, self._modules)
        if self.max_bytes and weights.nbytes > self.max_bytes:
            raise AdapterError(f"adapter: {name!r} needs {weights.nbytes / MIB:.1f} MiB, more than this worker's "
                               f"MLXQ_ADAPTER_MEMORY_MB of {self.max_bytes / MIB:.1f} MiB")
        for old_key in [k for k, r in self._resident.items() if r.weights.source.name == name and not r.pins]:
            self._evict(old_key)  # an older publication of the name, not in use
        slot = next((i for i, key in enumerate(self._slots) if i and key is None), len(self._slots))
        if slot == len(self._slots):
            self._slots.append(None)
        self._slots[slot] = source.key
        resident = _Resident(weights, slot)
        self._resident[source.key] = resident
        self._patch(weights)
        self.loads += 1
        self._stale = True
        self._trim(keep=source.key)
        log.info("adapter %s resident in slot %d (%.1f MiB; %d resident, %.1f MiB)", name, slot,
                 weights.nbytes / MIB, len(self._resident), self.resident_bytes / MIB)
        return resident

    def _trim(self, keep: Optional[str] = None) -> None:
        """Evict the least recently used adapters no sequence holds while the residents exceed the cap."""
        if not self.max_bytes:
            return
        for key in list(self._resident):
            if self.resident_bytes <= self.max_bytes:
                return
            if key != keep and not self._resident[key].pins:
                self._evict(key)

    def _evict(self, key: str) -> None:
        resident = self._resident.pop(key)
        self._slots[resident.slot] = None
        while len(self._slots) > 1 and self._slots[-1] is None:
            self._slots.pop()
        self.evictions += 1
        self._stale = True
        log.info("adapter %s evicted", resident.weights.source.name)

    def _patch(self, weights: LoraWeights) -> None:
        for path in weights.layers:
            module = self._modules[path]
            site = getattr(module, "_mlxq_lora", None)
            if isinstance(site, _Site):
                site.state = self.state
                continue
            object.__setattr__(module, "_mlxq_lora", _Site(path, self.state))
            module.__class__ = _lora_class(type(module))

    # --- the rows of the next model call --------------------------------------------------
    @contextmanager
    def rows(self, slots: list[int]) -> Iterator[None]:
        """Model calls inside run their rows with these adapter slots (0: the base model); all
        base rows leave the state empty, so those calls are the model's own. Emptied on the way
        out: the model run by anything else is the base model."""
        if any(slots):
            if self._stale:
                self._restack()
            self.state["stacks"] = self._stacks
            self.state["index"] = mx.array(slots, dtype=mx.uint32)
        try:
            yield
        finally:
            self.state.clear()

    def _restack(self) -> None:
        """Stack every resident adapter's A and B per adapted layer, in slot order, padded to a
        power-of-two number of slots (so residents coming and going seldom change a shape). Built
        on the host (numpy: one copy to the device per matrix, not an MLX op per slot) as new
        arrays, so a step in flight keeps the stacks it was launched with."""
        capacity = 1 << max(0, (len(self._slots) - 1).bit_length())
        by_slot = {r.slot: r.weights for r in self._resident.values()}
        ranks: dict[str, int] = {}
        for weights in by_slot.values():
            for path, (a, _) in weights.layers.items():
                ranks[path] = max(ranks.get(path, 0), int(a.shape[1]))
        stacks: dict[str, list[mx.array]] = {}
        for path, rank in ranks.items():
            module = self._modules[path]
            inputs, outputs = linear_dims(module)
            dtype = module.scales.dtype if "scales" in module else module.weight.dtype
            a_stack = np.zeros((capacity, inputs, rank), dtype=np.float32)
            b_stack = np.zeros((capacity, rank, outputs), dtype=np.float32)
            for slot, weights in by_slot.items():
                pair = weights.layers.get(path)
                if pair is not None:
                    a_stack[slot, :, :pair[0].shape[1]] = pair[0]
                    b_stack[slot, :pair[1].shape[0], :] = weights.scale * pair[1]
            stacks[path] = [_on_device(a_stack, dtype), _on_device(b_stack, dtype)]
        mx.eval(stacks)
        self._stacks = stacks
        self._stale = False


def _on_device(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(array)
    return out if out.dtype == dtype else out.astype(dtype)
