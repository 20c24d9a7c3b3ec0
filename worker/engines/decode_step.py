"""The compiled decode step: one `mx.compile`d call of the model over slot buffers per
(slots, length) shape, and the shape ladder those buckets come from.

The model's weights are passed to `mx.compile` as implicit inputs (not baked in as constants), so
weights swapped under a running engine are read by the next step without a recompile.

A shape is compiled the first time a step needs it, in that step, unless `may_compile` says its
kernels are not built yet (worker/engines/kernel_prebuild.py builds them in another process):
then that step runs the same function uncompiled, with the same result, and a later step of that
shape compiles it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx

from worker.engines.slot_cache import SlotBuffers

log = logging.getLogger("mlxq.engine")

# The smallest length bucket: shorter sequences share one compiled shape.
MIN_LENGTH_BUCKET = 128


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest value of the ladder 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^(k-1),
    from `smallest`) that is at least `n`: at most a third of a bucket is padding."""
    size = max(1, smallest)
    while size < n:
        power = 1 << (size.bit_length() - 1)
        size = power * 3 // 2 if size == power and power > 1 else power * 2
    return size


def ladder(upto: int, smallest: int = 1) -> list[int]:
    """Every bucket from `smallest` up to the one that holds `upto`."""
    sizes, size = [], bucket(smallest, smallest)
    while True:
        sizes.append(size)
        if size >= upto:
            return sizes
        size = bucket(size + 1, smallest)


@dataclass
class CompileRecord:
    slots: int
    length: int
    seconds: float  # a warm-up's: tracing and one run; a step's: tracing (its run is the step's)
    at_start: bool  # compiled by the warm-up, not by a running batch


class DecodeStep:
    """`step(tokens, positions, buffers) -> logits`: one token of every slot through the model,
    the buffers updated in place (the caller's `SlotBuffers` takes the new arrays)."""

    def __init__(self, model: Any, grouped_mask: bool = False, extra_inputs: Optional[dict[str, Any]] = None,
                 may_compile: Optional[Callable[[tuple[int, int]], bool]] = None) -> None:
        """`extra_inputs`: a dict the model reads while it runs (the LoRA stacks and rows,
        worker/engines/lora.py), an input of every call as the weights are. `may_compile(shape)`:
        whether a step may compile `shape` now (None: always)."""
        self.model = model
        self.grouped_mask = grouped_mask
        self.may_compile = may_compile
        self._compiled = mx.compile(self._decode, inputs=[model] if extra_inputs is None else [model, extra_inputs])
        self.shapes: dict[tuple[int, int], CompileRecord] = {}
        self.uncompiled_steps = 0  # steps run uncompiled while their shape's kernels were being built

    def _decode(self, tokens: mx.array, positions: mx.array, arrays: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
        half = len(arrays) // 2
        buffers = SlotBuffers(arrays[:half], arrays[half:])
        caches = buffers.layer_caches(positions, self.grouped_mask)
        logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
        buffers.absorb(caches)
        return logits, buffers.arrays()

    def __call__(self, tokens: mx.array, positions: mx.array, buffers: SlotBuffers) -> mx.array:
        shape = (buffers.slots, buffers.length)
        if shape in self.shapes:
            logits, arrays = self._compiled(tokens, positions, buffers.arrays())
        elif self.may_compile is not None and not self.may_compile(shape):
            self.uncompiled_steps += 1
            logits, arrays = self._decode(tokens, positions, buffers.arrays())
        else:
            started = time.perf_counter()
            logits, arrays = self._compiled(tokens, positions, buffers.arrays())
            record = CompileRecord(shape[0], shape[1], time.perf_counter() - started, at_start=False)
            self.shapes[shape] = record
            log.info("decode step: compiled %d slots x %d positions at first use (traced in %.2f s)",
                     record.slots, record.length, record.seconds)
        half = len(arrays) // 2
        buffers.keys, buffers.values = arrays[:half], arrays[half:]
        return logits

    def warm_up(self, layout: Any, shapes: Iterable[tuple[int, int]]) -> float:
        """Compile (and run once) every (slots, length) shape not compiled yet; the seconds it took."""
        started = time.perf_counter()
        for slots, length in shapes:
            if (slots, length) not in self.shapes:
                self._compile(SlotBuffers.allocate(layout, slots, length), at_start=True)
        return time.perf_counter() - started

    def _compile(self, buffers: SlotBuffers, at_start: bool) -> None:
        """Trace and run the step once on throwaway copies of the shape (the first run of a shape
        is where MLX builds its kernels, unless they are on disk already), and record how long it took."""
        started = time.perf_counter()
        scratch = SlotBuffers([mx.zeros_like(a) for a in buffers.keys], [mx.zeros_like(a) for a in buffers.values])
        tokens = mx.zeros((buffers.slots,), mx.uint32)  # the dtypes of a real step: a new dtype recompiles
        positions = mx.zeros((buffers.slots,), mx.int32)
        logits, arrays = self._compiled(tokens, positions, scratch.arrays())
        mx.eval(logits, arrays)
        record = CompileRecord(buffers.slots, buffers.length, time.perf_counter() - started, at_start)
        self.shapes[(buffers.slots, buffers.length)] = record

    @property
    def compile_seconds(self) -> float:
        return sum(r.seconds for r in self.shapes.values())
