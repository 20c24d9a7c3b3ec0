"""The verification forward pass on the compiled engine's slot buffers: every slot's next input and
up to k proposed tokens after it, (slots x width) positions in one model call, written at each
slot's own positions; the logits at every position come back.

A slot that proposes nothing runs its one input at position 0 of its row; the rest of its row is
padding, written past its position where the mask hides it until a later step overwrites it. A row
whose proposal is cut short by a rejection is "rolled back" the same way: its position moves to
the end of what was accepted, and the rejected tokens' keys and values are overwritten later.

Like the decode step (worker/engines/decode_step.py) the call is one `mx.compile`d function, traced
once per (slots, length, width) shape, with the model's weights and the LoRA state as its inputs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import mlx.core as mx

from worker.engines.slot_cache import SlotBuffers

log = logging.getLogger("mlxq.engine")


class VerifyStep:
    """`step(tokens, positions, buffers) -> logits`: tokens (slots, width) through the model at each
    slot's position, the buffers updated (the caller's `SlotBuffers` takes the new arrays); logits
    (slots, width, vocabulary)."""

    def __init__(self, model: Any, grouped_mask: bool = False, extra_inputs: Optional[dict[str, Any]] = None) -> None:
        self.model = model
        self.grouped_mask = grouped_mask
        self._compiled = mx.compile(self._verify, inputs=[model] if extra_inputs is None else [model, extra_inputs])
        self.shapes: set[tuple[int, int, int]] = set()
        self.traced = False  # whether the last call traced its shape (its time is not a pass's)

    def _verify(self, tokens: mx.array, positions: mx.array, arrays: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
        half = len(arrays) // 2
        buffers = SlotBuffers(arrays[:half], arrays[half:])
        caches = buffers.layer_caches(positions, self.grouped_mask)
        logits = self.model(tokens, cache=caches)
        buffers.absorb(caches)
        return logits, buffers.arrays()

    def warm_up(self, layout: Any, slots: int, length: int, widths: Sequence[int]) -> None:
        """Compile and run the pass once at each width on throwaway buffers of (`slots`, `length`): the
        first run of a shape is where MLX builds its kernels (worker/engines/kernel_prebuild.py)."""
        for width in widths:
            scratch = SlotBuffers.allocate(layout, slots, length)
            tokens = mx.zeros((slots, width), mx.uint32)  # a real pass's dtypes: a new dtype recompiles
            logits, arrays = self._compiled(tokens, mx.zeros((slots,), mx.int32), scratch.arrays())
            mx.eval(logits, arrays)
            self.shapes.add((slots, length, width))

    def __call__(self, tokens: mx.array, positions: mx.array, buffers: SlotBuffers) -> mx.array:
        shape = (buffers.slots, buffers.length, tokens.shape[1])
        started = time.perf_counter()
        logits, arrays = self._compiled(tokens, positions, buffers.arrays())
        self.traced = shape not in self.shapes
        if self.traced:
            self.shapes.add(shape)
            log.info("verify step: compiled %d slots x %d positions x %d tokens at first use (traced in %.2f s)",
                     shape[0], shape[1], shape[2], time.perf_counter() - started)
        half = len(arrays) // 2
        buffers.keys, buffers.values = arrays[:half], arrays[half:]
        return logits
