"""A shape-stable KV cache: one preallocated (slots, kv heads, length, head dim) buffer per layer,
each slot a sequence of its own, written at its own position.

`SlotLayerCache` is what a model's attention layer sees, with the interface mlx-lm's layers use:
`offset` (here a vector, one position per slot: RoPE takes it per row), `update_and_fetch`
(writes the new keys and values at each slot's position and returns the whole buffer) and
`make_mask` (a boolean mask that hides every position past a slot's own). A decode step's arrays
therefore have the same shapes from one step to the next, whatever the sequences' lengths, so one
compiled function serves every step of a (slots, length) shape.

`SlotBuffers` owns the per-layer arrays between steps: it grows and shrinks them (copies), writes
a sequence's cached prefix into a slot, and hands a slot's tokens back as mlx-lm `KVCache` objects
for the prefix cache.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class SlotLayerCache:
    """One layer's view of the slot buffers for one model call: slot b's new tokens go to positions
    `positions[b]`, `positions[b] + 1`, ... and it attends to every position up to its own."""

    def __init__(self, keys: mx.array, values: mx.array, positions: mx.array, grouped_mask: bool = False) -> None:
        self.keys = keys
        self.values = values
        self.positions = positions
        self.grouped_mask = grouped_mask

    @property
    def offset(self) -> mx.array:
        return self.positions

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        steps = keys.shape[2]
        where = self.positions[:, None, None, None]
        if steps > 1:
            where = where + mx.arange(steps)[None, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(where, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(where, values.shape), values, axis=2)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None,
                  **kwargs: Any) -> mx.array:
        if window_size is not None:
            raise ValueError("slot caches have no sliding window: this model needs mlx-lm's own caches")
        queries = self.positions[:, None] + mx.arange(N)[None]  # (slots, N): each query's position
        visible = mx.arange(self.keys.shape[2])[None, None, :] <= queries[:, :, None]
        if self.grouped_mask:
            return visible[:, None, None]  # (slots, 1, 1, N, length): over kv heads and their groups
        return visible[:, None]  # (slots, 1, N, length): broadcast over heads


class SlotBuffers:
    """The per-layer key and value arrays of every slot, `slots x length` positions each."""

    def __init__(self, keys: list[mx.array], values: list[mx.array]) -> None:
        self.keys = keys
        self.values = values

    @classmethod
    def allocate(cls, layout: "KVLayout", slots: int, length: int) -> "SlotBuffers":
        keys = [mx.zeros((slots, h, length, d), layout.dtype) for h, d in layout.key_shapes]
        values = [mx.zeros((slots, h, length, d), layout.dtype) for h, d in layout.value_shapes]
        return cls(keys, values)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def check_room(self, positions: Sequence[int], width: int) -> None:
        """Refuse a call that would write `width` positions from a slot's position past the buffers:
        MLX's scatter does not check its indices, so such a write would corrupt memory instead."""
        top = max(positions, default=0) + width
        if top > self.length:
            raise RuntimeError(f"slot buffers: a call would write up to position {top} of a buffer of {self.length} "
                               f"(positions {list(positions)}, width {width})")

    def layer_caches(self, positions: mx.array, grouped_mask: bool = False) -> list[SlotLayerCache]:
        return [SlotLayerCache(k, v, positions, grouped_mask) for k, v in zip(self.keys, self.values)]

    def absorb(self, caches: Sequence[SlotLayerCache]) -> None:
        """Take the arrays a model call left in `caches` (made by `layer_caches`)."""
        self.keys = [c.keys for c in caches]
        self.values = [c.values for c in caches]

    def resized(self, slots: int, length: int, keep: Sequence[int]) -> "SlotBuffers":
        """New buffers of `slots x length` whose slot i holds this one's slot keep[i] (its first
        `length` positions); the other slots are zeros."""
        index = mx.array(list(keep), dtype=mx.int32)

        def move(old: mx.array) -> mx.array:
            new = mx.zeros((slots, old.shape[1], length, old.shape[3]), old.dtype)
            if keep:
                span = min(length, old.shape[2])
                new[: len(keep), :, :span, :] = old[index, :, :span, :]
            return new

        return SlotBuffers([move(a) for a in self.keys], [move(a) for a in self.values])

    def write_prefix(self, slots: Sequence[int], cache: Sequence[Any], tokens: int) -> None:
        """Put the first `tokens` positions of `cache` (mlx-lm per-layer caches of one sequence)
        into each of `slots`."""
        for layer, c in enumerate(cache):
            keys, values = c.state[0], c.state[1]
            for slot in slots:
                self.keys[layer][slot, :, :tokens, :] = keys[0, :, :tokens, :]
                self.values[layer][slot, :, :tokens, :] = values[0, :, :tokens, :]

    def gather(self, slots: Sequence[int], length: int) -> "SlotBuffers":
        """The first `length` positions of `slots`, as buffers of their own (a copy)."""
        index = mx.array(list(slots), dtype=mx.int32)
        return SlotBuffers([a[index, :, :length, :] for a in self.keys], [a[index, :, :length, :] for a in self.values])

    def scatter(self, slots: Sequence[int], part: "SlotBuffers") -> None:
        """Write `part` (from `gather(slots, ...)`) back into `slots`."""
        index = mx.array(list(slots), dtype=mx.int32)
        span = part.length
        for layer in range(len(self.keys)):
            self.keys[layer][index, :, :span, :] = part.keys[layer]
            self.values[layer][index, :, :span, :] = part.values[layer]

    def extract(self, slot: int, tokens: int) -> list[KVCache]:
        """Slot `slot`'s first `tokens` positions as mlx-lm `KVCache`s, copied out of the buffers
        (a view would keep the whole buffer alive and stop the next step from updating it in place)."""
        positions = mx.arange(tokens)
        caches = []
        for keys, values in zip(self.keys, self.values):
            cache = KVCache()
            cache.state = (mx.take(keys[slot:slot + 1], positions, axis=2),
                           mx.take(values[slot:slot + 1], positions, axis=2), tokens)
            caches.append(cache)
        return caches


class KVLayout:
    """The per-layer shapes and dtype of a model's KV cache, read off one token run through it, and
    the mask shape its attention broadcasts: gemma2's grouped-query attention computes its scores as
    (batch, kv heads, repeats, queries, keys) and applies the mask to those itself."""

    def __init__(self, key_shapes: list[tuple[int, int]], value_shapes: list[tuple[int, int]], dtype: Any,
                 grouped_mask: bool = False) -> None:
        self.key_shapes = key_shapes
        self.value_shapes = value_shapes
        self.dtype = dtype
        self.grouped_mask = grouped_mask

    @classmethod
    def of(cls, model: Any) -> "KVLayout":
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        model(mx.array([[0]]), cache=cache)
        keys = [c.state[0] for c in cache]
        values = [c.state[1] for c in cache]
        mx.eval(keys, values)
        attention = getattr(model.layers[0], "self_attn", None)
        grouped = getattr(model, "model_type", None) == "gemma2" and getattr(attention, "repeats", 1) > 1
        return cls([(k.shape[1], k.shape[3]) for k in keys], [(v.shape[1], v.shape[3]) for v in values],
                   keys[0].dtype, grouped)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one position of one slot takes, over every layer."""
        size = mx.zeros((1,), self.dtype).itemsize
        return size * (sum(h * d for h, d in self.key_shapes) + sum(h * d for h, d in self.value_shapes))
