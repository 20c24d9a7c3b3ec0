"""Prompts into the compiled engine's slot buffers (worker/engines/compiled.py): the model run over
them, in chunks of `prefill_step_size` positions, and, where the engine asks, each prompt's logits
at its last position, from which its first token is sampled.

A batch of prompts is gathered out of its slots, run right-padded in one model call per chunk, and
scattered back; padding positions lie past each slot's position, where the mask hides them until
decoding overwrites them. A lone prompt with nothing cached runs on mlx-lm's own cache (a causal
prefill: no gather, scatter or slot mask) and is then written into its slot, which on CUDA costs the
host about a third less (docs/bench/h200/dec02b).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.engines.compiled_rows import WaitingPrompt
from worker.engines.lora import LoraBank
from worker.engines.slot_cache import SlotBuffers


class SlotPrefill:
    def __init__(self, model: Any, lora: LoraBank, grouped_mask: bool, step_size: int) -> None:
        self.model = model
        self._lora = lora
        self._grouped_mask = grouped_mask
        self._step_size = step_size

    def on_own_cache(self, tokens: list[int], cache: Optional[list[Any]] = None, adapter_slot: int = 0
                     ) -> tuple[list[Any], mx.array]:
        """Run `tokens` through the model (under the adapter in `adapter_slot`) on top of `cache`
        (mlx-lm caches; fresh ones if None), in place: the cache, and the logits of the last chunk
        (both lazy: the caller evaluates what it needs)."""
        cache = make_prompt_cache(self.model) if cache is None else cache
        logits = None
        for start in range(0, len(tokens), self._step_size):
            if start:
                mx.eval([c.state for c in cache])
            with self._lora.rows([adapter_slot]):
                logits = self.model(mx.array(tokens[start:start + self._step_size])[None], cache=cache)
        assert logits is not None
        return cache, logits

    def alone_into_slot(self, buffers: SlotBuffers, entry: WaitingPrompt, with_last: bool) -> Optional[mx.array]:
        """A lone prompt with nothing cached, into its slot; with `with_last` its last prompt token
        too, and its logits there (one row)."""
        tokens = entry.to_prefill(with_last)
        cache, logits = self.on_own_cache(tokens, None, entry.seq.adapter_slot)
        buffers.write_prefix([entry.seq.slot], cache, len(tokens))
        return logits[:, -1, :] if with_last else None

    def batch(self, buffers: SlotBuffers, entries: list[WaitingPrompt], with_last: bool) -> Optional[mx.array]:
        """Every entry's tokens into its slot, right-padded, in one batch; with `with_last` the last
        prompt token too, and the logits at each entry's last prompt position, a row per entry."""
        slots = [e.seq.slot for e in entries]
        rests = [e.to_prefill(with_last) for e in entries]
        width = max(len(r) for r in rests)
        part = buffers.gather(slots, max(e.cached for e in entries) + width)
        tokens = mx.array([r + [0] * (width - len(r)) for r in rests], dtype=mx.int32)
        last: list[tuple[int, mx.array]] = []  # (entry, its logits at its last position)
        for start in range(0, width, self._step_size):
            if start:
                mx.eval(part.arrays(), [row for _, row in last])
            caches = part.layer_caches(mx.array([e.cached + start for e in entries], dtype=mx.int32),
                                       self._grouped_mask)
            chunk = tokens[:, start:start + self._step_size]
            with self._lora.rows([e.seq.adapter_slot for e in entries]):
                logits = self.model(chunk, cache=caches)
            part.absorb(caches)
            if with_last:
                ending = [i for i, r in enumerate(rests) if start <= len(r) - 1 < start + chunk.shape[1]]
                if ending:
                    rows = logits[mx.array(ending), mx.array([len(rests[i]) - 1 - start for i in ending])]
                    last += zip(ending, rows)
        buffers.scatter(slots, part)
        if not with_last:
            return None
        last.sort(key=lambda pair: pair[0])
        return mx.stack([row for _, row in last])
