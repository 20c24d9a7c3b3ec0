"""Vision engine: mlx-vlm's BatchGenerator behind the Engine protocol, for image and text requests
in one continuous batch.

Uses mlx-vlm's public API: `load` (worker/loading.py), the model's processor (chat template, image
processor, image-token expansion), `model.get_input_embeddings` (the vision encoder and Qwen-VL's
3-D rope positions), and `BatchGenerator.insert(prompts, max_tokens, prompt_kwargs,
logits_processors) / next / remove`. mlx-lm's engine fed with these caches is not exact for Qwen-VL
(shared/notes/mlx.md), so every request, text-only ones too, goes through mlx-vlm's generator.

What mlx-vlm's generator does batch-wide, this engine does per row:
- sampling: its one sampler is a RowSampler (worker/engines/row_sampler.py) that samples each row by
  its own settings, named to it by the row's first logits processor;
- stopping: its stop test is the tokenizer's, for the whole batch; the engine hands it one that never
  stops and ends each row on its own stop ids (EOS unless ignore_eos, plus stop_token_ids);
- logprobs: the distribution each token was drawn from is kept per row (raw, or processed) and the
  chosen and top logprobs taken from it as on the text path (worker/engines/sampling.py).
`prepare` turns an image request into token ids with the image tokens expanded and the processor's
pixels; the vision encoder runs when the request enters the batch (`add`), once for its n choices,
whose rows then prefill together in one batched call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_vlm.generate import BatchGenerator

from schemas import GenerationRequest
from worker.engines.base import EngineStats, Prompt, SequenceSpec, TokenEvent, adapter_not_served
from worker.engines.constraints import (CompiledConstraint, ConstraintCompiler, MaskBatch, RowConstraint, fenced,
                                       finish_token)
from worker.engines.row_sampler import RowSampler, SampledRow
from worker.engines.sampling import (RawLogits, RowGuard, attach_logprobs, logits_processors, needs_raw_capture,
                                     repair_random_state, requested_distribution)
from worker.engines.text import RequestRejected, measure_kv_bytes_per_token, model_context_length
from worker.engines.weight_swap import ParameterSpec, parameter_spec, swap_into
from worker.images import ImagePolicy, image_bytes, load_image

# Model types whose processor and `get_input_embeddings` this engine is written against.
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class VisionInputs:
    """What a request carries beside its token ids (`Prompt.inputs`): the processor's output for its
    images, and its compiled constraint (structured output)."""

    # NumPy, not MLX: `prepare` may run on another thread, and an MLX array belongs to the stream
    # of the thread that made it. (patches, channels x temporal x patch x patch); (images, 3).
    pixel_values: Optional[np.ndarray] = None
    image_grid_thw: Optional[np.ndarray] = None  # each image's grid of patches
    images: int = 0
    constraint: Optional[CompiledConstraint] = None

    def image_arrays(self) -> tuple[Optional[mx.array], Optional[mx.array]]:
        """The pixel values and grids as MLX arrays, made on the calling thread's stream."""
        if self.pixel_values is None:
            return None, None
        return mx.array(self.pixel_values), mx.array(self.image_grid_thw)


@dataclass
class VisionCounters:
    """Where the engine's time went, since it started (published in the worker's stats hash)."""

    images: int = 0
    vision_calls: int = 0  # vision-encoder runs: one per image request, shared by its n choices
    vision_s: float = 0.0  # the encoder and the input embeddings of every request
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    peak_sequences: int = 0  # most sequences in the engine at once

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NoBatchStop:
    """Stands in for the processor mlx-vlm's BatchGenerator takes: the generator reads only its
    `stopping_criteria`, a batch-wide stop test, and this one never stops a row (each row stops on
    its own ids in `VisionEngine.step`)."""

    def __init__(self) -> None:
        self.stopping_criteria = self

    def add_eos_token_ids(self, token_ids: Any = None) -> None:
        return None

    def __call__(self, token: int) -> bool:
        return False


@dataclass
class _Row:
    spec: SequenceSpec
    sampled: SampledRow  # its state in the RowSampler
    namer: Any  # its first logits processor: names the row to the RowSampler
    guard: RowGuard
    capture: Optional[RawLogits]  # its raw logits, where processors change them and raw logprobs are asked
    constraint: Optional[RowConstraint] = None  # its structured-output mask

    @property
    def error(self) -> Optional[str]:
        """Why the row's own code failed (a processor, its constraint's matcher), if it did."""
        return self.guard.error or (self.constraint.error if self.constraint is not None else None)

    def release(self) -> None:
        if self.constraint is not None:
            self.constraint.release()


class VisionEngine:
    adapter_batching = None  # the scheduler fails requests that name an adapter, with this reason
    adapter_refusal = "the vision engine (mlx-vlm) serves no LoRA adapters"

    def register_adapter(self, name: str, directory: Path) -> None:
        raise adapter_not_served(name, self.adapter_refusal)

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        max_num_seqs: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        images: ImagePolicy = ImagePolicy(),
    ) -> None:
        from mlx_vlm.utils import resolve_eos_token_ids

        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r}: mlxq's vision engine serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self._images = images
        self._image_token_id = int(model.config.image_token_id)
        # An image larger than the processor's bound is scaled down as soon as it is decoded.
        self._fit_pixels: Optional[int] = getattr(getattr(processor, "image_processor", None), "max_pixels", None)
        self._vocab_size = int(model.language_model.args.vocab_size)
        self._eos = frozenset(resolve_eos_token_ids(getattr(model.config, "eos_token_id", None), self.tokenizer))
        self._generator_options = dict(
            # mlx-vlm starts a prefill batch only while this many more rows fit: above what the
            # scheduler admits (max_num_seqs), a prefill never waits for the decode batch to shrink.
            completion_batch_size=max_num_seqs + prefill_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
            compute_logprobs=False,  # taken per row, from the distributions the sampler keeps
        )
        self._sampler = RowSampler()
        self._constraints = ConstraintCompiler(self.tokenizer, self._vocab_size, self._eos)
        self._masks: Optional[MaskBatch] = None  # made with the first constrained row
        self._max_num_seqs = max_num_seqs
        self._generator = self._new_generator()
        self._live: dict[int, _Row] = {}
        self._engine_uid: dict[str, int] = {}
        self._failed: list[TokenEvent] = []  # rows whose request could not be embedded, reported next step
        self._counters = VisionCounters()
        self._version = 0  # of the weights now (swap_weights)
        self._launched_with = 0  # the version mlx-vlm's last call launched its forward pass with
        self._kv_bytes_per_token = measure_kv_bytes_per_token(model.language_model)
        self._encoder_bytes_per_patch, self._encoder_heads = _encoder_shape(model)
        self._embed_bytes_per_token = int(model.language_model.args.hidden_size) * 4

    def _new_generator(self) -> BatchGenerator:
        # The constrained rows' masks are filled together right before the batch is sampled.
        return BatchGenerator(self.model.language_model, NoBatchStop(), sampler=fenced(self._sampler, self._fill_masks),
                              **self._generator_options)

    def _fill_masks(self) -> None:
        if self._masks is not None:
            self._masks.fill()

    def _mask_batch(self) -> MaskBatch:
        if self._masks is None:
            self._masks = MaskBatch(self._vocab_size, 2 * self._max_num_seqs)
        return self._masks

    # --- the Engine protocol's properties --------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def num_active(self) -> int:
        return len(self._live)

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    @property
    def context_length(self) -> Optional[int]:
        return model_context_length(self.model.language_model)

    def stats(self) -> EngineStats:
        return EngineStats(counters=self._counters.as_dict(),
                           prefix_cache={"enabled": False, "disabled_reason": "the vision engine keeps no prefix cache"})

    # --- weight versions (worker/weights.py) -------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def swap_weights(self, files: list[Path], version: int) -> None:
        swap_into(self.model, files)  # all or nothing: the language model and the vision tower
        self._version = version

    def reset_prefix_cache(self) -> None:
        return None  # it keeps none

    def parameter_spec(self) -> ParameterSpec:
        return parameter_spec(self.model)

    # --- requests -------------------------------------------------------------------------
    def read_image(self, field: str, url: str, deadline: float) -> bytes:
        return image_bytes(url, field, self._images, deadline)

    def prepare(self, request: GenerationRequest, fetched: Optional[Mapping[str, bytes]] = None) -> Prompt:
        """The request's token ids and the processor's pixels; images in files or at URLs come in
        `fetched` (by field) when they were read already, and are read here otherwise."""
        constraint = None
        if request.constraint is not None:
            if request.ignore_eos:
                raise RequestRejected(f"ignore_eos: cannot be combined with {request.constraint.field.split('.')[0]}, "
                                      "which ends the text where the constraint allows EOS")
            constraint = self._constraints.compile(request.constraint)
        plain = None if constraint is None else VisionInputs(constraint=constraint)
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if self._image_token_id in ids:
                raise RequestRejected(f"prompt_token_ids: the image token ({self._image_token_id}) needs its image; "
                                      "send images as image_url parts of messages")
            return Prompt(ids, inputs=plain)
        if request.prompt is not None:
            return Prompt(list(self.tokenizer.encode(request.prompt)), inputs=plain)
        assert request.messages is not None
        messages, sources = _template_messages(request)
        text = self._apply_chat_template(messages, request.chat_template_kwargs or {})
        if not sources:
            return Prompt(list(self.tokenizer.encode(text, add_special_tokens=False)), inputs=plain)
        read = fetched or {}
        images = [load_image(url, field, self._images, self._fit_pixels, read.get(field)) for field, url in sources]
        try:
            features = self.processor(text=[text], images=images, add_special_tokens=False)
        except Exception as exc:  # e.g. an aspect ratio the model's resizing refuses
            raise RequestRejected(f"messages: the model's image processor refused the images: {exc}") from None
        ids = [int(t) for t in features["input_ids"][0].tolist()]
        inputs = VisionInputs(np.asarray(features["pixel_values"]), np.asarray(features["image_grid_thw"]), len(images),
                              constraint)
        return Prompt(ids, extra_bytes=self._encoder_bytes(inputs, len(ids)), inputs=inputs)

    def _apply_chat_template(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        for owner in (self.processor, self.tokenizer):
            if getattr(owner, "chat_template", None):
                try:
                    return str(owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs))
                except Exception as exc:  # a template's own raise_exception, or one that cannot take these messages
                    raise RequestRejected(f"messages: the model's chat template refused them: {type(exc).__name__}: "
                                          f"{str(exc)[:300]}") from None
        raise RequestRejected("messages: this model has no chat template; send `prompt` or `prompt_token_ids`")

    def _encoder_bytes(self, inputs: VisionInputs, prompt_tokens: int) -> int:
        """An estimate of the memory the vision encoder and the input embeddings take while the
        request enters: the patches' activations in one encoder block, each image's attention
        scores, and the embedded prompt."""
        assert inputs.image_grid_thw is not None and inputs.pixel_values is not None
        grids = [int(t) * int(h) * int(w) for t, h, w in inputs.image_grid_thw.tolist()]
        patches = sum(grids)
        return (patches * (inputs.pixel_values.shape[-1] * 4 + self._encoder_bytes_per_patch)
                + self._encoder_heads * sum(n * n for n in grids) * 4
                + prompt_tokens * self._embed_bytes_per_token)

    def add(self, specs: list[SequenceSpec]) -> None:
        """Queue sequences. The choices of one request share its input embeddings (the vision
        encoder runs once for them) and enter mlx-vlm's queue together, so they prefill in one call."""
        by_request: dict[str, list[SequenceSpec]] = {}
        for spec in specs:
            by_request.setdefault(spec.request_id, []).append(spec)
        for request_specs in by_request.values():
            first = request_specs[0]
            try:
                embedded = self._embed(first.prompt_token_ids, first.inputs)
            except Exception as exc:  # this request's inputs only: its neighbours go on
                self._failed += [TokenEvent(uid=s.uid, token=-1, index=s.choice_index,
                                            error=f"{type(exc).__name__} in the vision encoder: {exc}")
                                 for s in request_specs]
                continue
            rows = [self._row(spec) for spec in request_specs]
            uids = self._generator.insert(
                [list(spec.prompt_token_ids) for spec in request_specs],
                max_tokens=[spec.max_tokens for spec in request_specs],
                prompt_kwargs=[dict(embedded) for _ in request_specs],
                logits_processors=[self._processors(row) for row in rows],
            )
            for uid, row in zip(uids, rows):
                self._live[uid] = row
                self._engine_uid[row.spec.uid] = uid
        self._counters.peak_sequences = max(self._counters.peak_sequences, len(self._live))

    def _embed(self, token_ids: list[int], inputs: Optional[VisionInputs]) -> dict[str, mx.array]:
        """The prompt's input embeddings and rope positions (the vision encoder's output merged in)."""
        started = time.perf_counter()
        ids = mx.array([token_ids])
        if inputs is None or inputs.pixel_values is None:
            output = self.model.get_input_embeddings(ids, None)
        else:
            pixel_values, image_grid_thw = inputs.image_arrays()
            output = self.model.get_input_embeddings(ids, pixel_values, image_grid_thw=image_grid_thw)
        embedded = {k: v for k, v in output.to_dict().items() if v is not None}
        mx.eval(list(embedded.values()))
        if inputs is not None and inputs.pixel_values is not None:
            self._counters.vision_calls += 1
            self._counters.images += inputs.images
        self._counters.vision_s += time.perf_counter() - started
        return embedded

    def _row(self, spec: SequenceSpec) -> _Row:
        wants = spec.logprobs or spec.top_logprobs > 0
        sampled, namer = self._sampler.row(spec.sampling, spec.choice_index, wants)
        compiled = spec.inputs.constraint if isinstance(spec.inputs, VisionInputs) else None
        constraint = (None if compiled is None else
                      RowConstraint(compiled, len(spec.prompt_token_ids), self._mask_batch()))
        capture = RawLogits() if needs_raw_capture(spec, constraint is not None) else None
        return _Row(spec, sampled, namer, RowGuard(), capture, constraint)

    def _processors(self, row: _Row) -> list[Any]:
        """The namer first, unguarded (it must run even after another processor of the row failed),
        then the row's own processors (its constraint's mask last), each guarded so its failure ends
        this row alone."""
        own = logits_processors(row.spec.sampling, len(row.spec.prompt_token_ids), row.capture, row.constraint)
        return [row.namer, *(row.guard.processor(p) for p in own)]

    # --- stepping -------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        if self._failed:
            events, self._failed = self._failed, []
            return events
        if not self._live:
            return []
        self._sampler.begin()
        if self._masks is not None:
            self._masks.begin_step()
        before = self._generator.stats()
        # mlx-vlm returns the tokens its previous call sampled while it launches the next forward
        # pass: after a swap, one more call's tokens come from the old weights.
        sampled_with, self._launched_with = self._launched_with, self._version
        started = time.perf_counter()
        _, responses = self._generator.next()
        elapsed = time.perf_counter() - started
        after = self._generator.stats()
        prefill_s = after.prompt_time - before.prompt_time
        self._counters.prefill_s += prefill_s
        self._counters.prefill_tokens += after.prompt_tokens - before.prompt_tokens
        if responses:
            self._counters.decode_steps += 1
            self._counters.decode_tokens += len(responses)
            self._counters.decode_s += max(0.0, elapsed - prefill_s)
        events: list[TokenEvent] = []
        wanted: list[tuple[TokenEvent, SequenceSpec, mx.array]] = []
        for response in responses:
            row = self._live.get(response.uid)
            if row is None:  # removed while its step was in flight
                continue
            spec = row.spec
            drawn = row.sampled.drawn_from.popleft() if row.sampled.keep_distributions else None
            raw = row.capture.pending.popleft() if row.capture is not None and row.capture.pending else None
            if row.error is not None:  # this row's own code failed: end it alone
                events.append(TokenEvent(uid=spec.uid, token=-1, index=spec.choice_index, error=row.error))
                self.remove([spec.uid])
                continue
            token = int(response.token)
            finish = "stop" if token in spec.stop_token_ids else response.finish_reason
            event = finish_token(row.constraint, TokenEvent(uid=spec.uid, token=token, index=spec.choice_index,
                                                            finish_reason=finish, weight_version=sampled_with))
            events.append(event)
            if drawn is not None and event.error is None:
                wanted.append((event, spec, requested_distribution(spec, drawn, raw)))
            if finish is not None:
                if response.finish_reason is None:  # mlx-vlm would go on: its stop test is not this row's
                    self._generator.remove(response.uid)
                self._forget(spec.uid)
        if wanted:
            attach_logprobs(wanted)
        return events

    def remove(self, uids: list[str]) -> None:
        for uid in uids:
            engine_uid = self._engine_uid.get(uid)
            if engine_uid is not None:
                self._generator.remove(engine_uid)
            self._forget(uid)

    def _forget(self, uid: str) -> None:
        engine_uid = self._engine_uid.pop(uid, None)
        if engine_uid is not None:
            row = self._live.pop(engine_uid, None)
            if row is not None:
                row.release()

    def reset(self) -> None:
        self._generator.close()
        self._sampler = RowSampler()
        self._masks = None  # its slots belonged to the rows of the failed batch
        self._generator = self._new_generator()
        self._live.clear()
        self._engine_uid.clear()
        self._failed.clear()
        self._launched_with = self._version
        repair_random_state()

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def _template_messages(request: GenerationRequest) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The messages as the chat template takes them (an image part becomes `{"type": "image"}`, which
    Qwen-VL templates render as the image placeholder) and each image's (field, url), in order."""
    assert request.messages is not None
    messages, sources = [], []
    for i, message in enumerate(request.messages):
        if message.tool_calls or message.content is None:
            raise RequestRejected(f"messages[{i}].tool_calls: this worker's vision engine does not serve tool calls")
        entry: dict[str, Any] = {"role": message.role}
        if message.name is not None:
            entry["name"] = message.name
        if isinstance(message.content, str):
            entry["content"] = message.content
        else:
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                else:
                    parts.append({"type": "image"})
                    sources.append((f"messages[{i}].content[{j}].image_url", part.image_url.url))
            entry["content"] = parts
        messages.append(entry)
    return messages, sources


def _encoder_shape(model: Any) -> tuple[int, int]:
    """(bytes one patch's activations take in an encoder block, attention heads), from the vision
    config: Qwen2-VL names its width embed_dim and its MLP by ratio, Qwen2.5-VL hidden_size and
    intermediate_size."""
    vision = model.config.vision_config
    width = int(getattr(vision, "embed_dim", 0) or vision.hidden_size)
    mlp = int(getattr(vision, "intermediate_size", 0) or width * float(getattr(vision, "mlp_ratio", 4.0)))
    # The block's input, its q, k and v, its attention output and the MLP's hidden layer, in float32.
    return (5 * width + mlp) * 4, int(vision.num_heads)
