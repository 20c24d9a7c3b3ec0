"""Load the served model once and build the engine + scheduler around it."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from worker.gguf import GGUFError, check_gguf, converted_directory, is_gguf
from worker.platform import apply_metal_limits, device_description, limit_blas_threads, preload_blas
from worker.settings import WorkerSettings
from worker.weight_prep import current_platform, prepare_weights

log = logging.getLogger("mlxq.worker")


class ModelLoadError(RuntimeError):
    """The configured model could not be loaded; the message says which and why."""


def check_model_setting(model: Optional[str]) -> None:
    """Fail fast, before registering with rq, on a model that is neither a directory, a GGUF file
    of tensor types MLX reads, nor a hub id."""
    if not model:
        raise ModelLoadError("no model configured: set MLXQ_MODEL or pass --model (a local path, a .gguf file or "
                             "a hub id)")
    if is_gguf(model):
        if not os.path.isfile(os.path.expanduser(model)):
            raise ModelLoadError(f"MLXQ_MODEL: {model!r}: no such GGUF file")
        try:
            check_gguf(Path(model).expanduser())
        except GGUFError as exc:
            raise ModelLoadError(f"MLXQ_MODEL: {exc}") from None
        return
    looks_local = os.path.isabs(model) or model.startswith(("./", "../", "~")) or model.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(model)):
        raise ModelLoadError(f"MLXQ_MODEL: {model!r} is not a directory (give a local model directory or a hub id "
                             "such as mlx-community/Qwen2.5-0.5B-Instruct-4bit)")


def load_model(settings: WorkerSettings) -> tuple[Any, Any]:
    """(model, tokenizer) through mlx-lm; for a vision-language model (model, processor) through mlx-vlm."""
    check_model_setting(settings.model)
    blas = preload_blas(settings.blas)
    blas_threads = limit_blas_threads(settings.blas_threads, blas) if settings.blas_threads else None
    started = time.perf_counter()
    try:
        model, tokenizer = _load(settings)
    except ModelLoadError:
        raise
    except GGUFError as exc:
        raise ModelLoadError(f"MLXQ_MODEL: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(f"MLXQ_MODEL: could not load {settings.model!r}: {type(exc).__name__}: {exc}") from exc
    loaded_s = time.perf_counter() - started
    formats = prepare_weights(model, upcast=settings.upcast, keep_quantized=settings.keep_quantized)
    limits = apply_metal_limits(settings.metal_wired_limit_mb, settings.metal_cache_limit_mb)
    log.info(
        "loaded %s in %.1f s (%s); BLAS: %s%s",
        settings.model,
        loaded_s,
        device_description(),
        blas.name + (f", {blas_threads}" if blas_threads else ""),
        f"; Metal {', '.join(limits)}" if limits else "",
    )
    if formats.notes:
        log.info("weights: %s (%.1f s)", "; ".join(formats.notes), time.perf_counter() - started - loaded_s)
    return model, tokenizer


def model_directory(model: str) -> str:
    """The directory mlx-lm / mlx-vlm load for `model`: a GGUF file's converted copy
    (worker/gguf.py), else `model` itself (a directory or a hub id)."""
    return str(converted_directory(Path(model))) if is_gguf(model) else model


def _load(settings: WorkerSettings) -> tuple[Any, Any]:
    assert settings.model
    path = model_directory(settings.model)
    if is_vision_model(path):
        try:
            from mlx_vlm import load as load_vlm
        except ImportError as exc:
            raise ModelLoadError(f"MLXQ_MODEL: {settings.model!r} is a vision-language model: install mlxq[vlm] "
                                 f"({exc})") from None
        return load_vlm(path, trust_remote_code=settings.trust_remote_code)
    from mlx_lm import load

    return load(path, tokenizer_config={"trust_remote_code": settings.trust_remote_code})


def build_engine(settings: WorkerSettings) -> Any:
    if settings.engine == "fake":
        from worker.engines.fake import FakeEngine

        log.info("engine: fake (deterministic, no model): for tests and queue benchmarks only")
        return FakeEngine(step_delay_s=settings.fake_step_delay_s)
    if settings.engine != "mlx":
        raise ValueError(f"MLXQ_ENGINE: unknown engine {settings.engine!r} (mlx | fake)")
    model, tokenizer = load_model(settings)
    if is_vision_model(settings.model or ""):
        from worker.engines.vision import VisionEngine

        log.info("engine: vision (mlx-vlm), for image and text requests")
        return VisionEngine(model, tokenizer, max_num_seqs=settings.max_num_seqs,
                            prefill_batch_size=settings.prefill_batch_size,
                            prefill_step_size=settings.prefill_step_size, images=settings.image_policy)
    return engine_for_model(settings, model, tokenizer)


def engine_for_model(settings: WorkerSettings, model: Any, tokenizer: Any, model_dir: Optional[str] = None) -> Any:
    """The text engine for a loaded model: mlxq's compiled decode path where it is exact (its decode
    step's kernels built as MLXQ_DECODE_WARMUP says, from `model_dir`, the served model's
    directory or hub id: default MLXQ_MODEL's), mlx-lm's BatchGenerator otherwise
    (worker/engines/decode_path.py)."""
    from worker.engines.decode_path import choose_decode_path

    path = choose_decode_path(model, settings.decode)
    log.info("decode path: %s (%s)", path.name, path.reason)
    from worker.adapters import AdapterCatalog

    options = dict(max_num_seqs=settings.max_num_seqs, prefill_batch_size=settings.prefill_batch_size,
                   prefill_step_size=settings.prefill_step_size, prefix_cache_bytes=settings.prefix_cache_bytes,
                   adapters=AdapterCatalog(settings.adapter_dir), adapter_memory_bytes=settings.adapter_memory_bytes,
                   tool_call_format=settings.tool_call_format, reasoning=settings.reasoning)
    if path.name == "compiled":
        from worker.engines.compiled import CompiledEngine

        engine = CompiledEngine(model, tokenizer, kv_budget_bytes=settings.kv_budget_bytes,
                                speculator=build_speculator(settings, model, tokenizer), **options)
        tokens, warmup = settings.decode_warmup_tokens, settings.decode_warmup
        model_dir = model_dir or (model_directory(settings.model) if settings.model else None)
        if tokens and warmup == "background" and model_dir is not None and current_platform() != "metal":
            engine.prebuild_kernels(model_dir, tokens)
            log.info("decode step: serving at once; kernels for %d shapes (up to %d slots x %d tokens) are built "
                     "in the background", len(engine.warm_up_shapes(tokens)), settings.max_num_seqs, tokens)
        elif tokens and warmup == "background":
            log.info("decode step: serving at once; each shape compiles at its first step (%s)",
                     "Metal builds its kernels in the worker's process" if model_dir else "no model directory to "
                     "build kernels from")
        elif tokens and warmup == "blocking":
            shapes, seconds = engine.warm_up(tokens)
            log.info("decode step warm-up: %d shapes (up to %d slots x %d tokens) compiled in %.1f s",
                     shapes, settings.max_num_seqs, tokens, seconds)
        return engine
    if settings.speculative != "off":
        log.warning("speculation: off: MLXQ_SPECULATIVE=%s needs the compiled decode path, and this model decodes "
                    "on mlx-lm's BatchGenerator (%s), whose steps take one token per row (docs/speculative.md)",
                    settings.speculative, path.reason)
    from worker.engines.text import TextEngine

    return TextEngine(model, tokenizer, **options)


def build_speculator(settings: WorkerSettings, model: Any, tokenizer: Any) -> Any:  # -> Optional[Speculator]
    """The speculation policy MLXQ_SPECULATIVE asks for (None: off); for `draft`, the draft model
    loaded as the served model is (a directory, a .gguf file or a hub id) and checked to share its tokenizer."""
    if settings.speculative == "off":
        return None
    from worker.engines.speculation import speculator_for
    from worker.engines.speculation.speculator import DEFAULT_PASS_COST
    from worker.engines.text_model import model_vocab_size

    drafter: Any
    if settings.speculative == "ngram":
        from worker.engines.speculation.ngram import NgramDrafter

        drafter = NgramDrafter()
    else:
        from worker.engines.speculation.draft_model import DraftModelDrafter, check_same_vocabulary

        assert settings.draft_model
        draft_settings = settings.replace(model=settings.draft_model, draft_model=None, speculative="off")
        try:
            check_model_setting(settings.draft_model)
            if is_vision_model(model_directory(settings.draft_model)):
                raise ModelLoadError("a vision-language model cannot draft")
            draft, draft_tokenizer = load_model(draft_settings)
        except ModelLoadError as exc:
            raise ModelLoadError(f"MLXQ_DRAFT_MODEL: {str(exc).removeprefix('MLXQ_MODEL: ')}") from None
        try:
            check_same_vocabulary(tokenizer, draft_tokenizer)
            drafter = DraftModelDrafter(draft, model_vocab_size(model, tokenizer))
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    from worker.engines.decode_path import rounds_below_float32

    if rounds_below_float32(model, current_platform()):
        log.warning("speculation: this model's arithmetic rounds below float32 (half-precision weights, or TF32 "
                    "matmuls on CUDA): a verification pass rounds its logits another way than a decode step, so a "
                    "greedy row may take the other side of a near-tie and write other text than without speculation; "
                    "where bitwise-equal tokens matter, serve float32 weights or send speculative: false "
                    "(docs/speculative.md)")
    measured = settings.speculative_pass_cost is None
    cost = settings.speculative_pass_cost or DEFAULT_PASS_COST[current_platform()]
    log.info("speculation: %s, up to %d tokens a row, at most %d positions a verification pass, a pass costing "
             "%.2f decode steps%s", settings.speculative if settings.speculative == "ngram"
             else f"draft model {settings.draft_model}", settings.speculative_k, settings.speculative_max_positions, cost,
             " until measured" if measured else "")
    return speculator_for(drafter, settings.speculative_k, settings.speculative_max_positions, cost,
                          measure_cost=measured)


def is_vision_model(model: str) -> bool:
    """Whether the model's config.json describes a vision-language model (it has a vision tower);
    a GGUF file holds a text model."""
    return not is_gguf(model) and "vision_config" in model_config(model)


def model_config(model: str) -> dict[str, Any]:
    """config.json of a local model directory, or of a hub model (from the hub cache, or downloaded)."""
    local = Path(model) / "config.json"
    if local.is_file():
        path = local
    elif Path(model).exists():
        raise RuntimeError(f"{model}: no config.json there")
    else:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "config.json"))
    return dict(json.loads(path.read_text()))


def build_scheduler(settings: WorkerSettings, worker_name: Optional[str] = None):  # -> BatchScheduler
    from worker.scheduler import BatchScheduler

    engine = build_engine(settings)
    return BatchScheduler(
        engine,
        max_num_seqs=settings.max_num_seqs,
        default_max_tokens=settings.default_max_tokens,
        limits=settings.limits,
        served_names=settings.served_names(),
        model_name=settings.served_alias,
        worker_name=worker_name or f"pid-{os.getpid()}",
        kv_budget_bytes=settings.kv_budget_bytes,
    )
