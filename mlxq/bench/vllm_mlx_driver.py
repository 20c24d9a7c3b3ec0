"""Arm E's driver: runs INSIDE the separate vllm-mlx venv (`python vllm_mlx_driver.py SPEC OUT`),
so it imports only the standard library, mlx and vllm_mlx (never mlxq).

It loads vllm-mlx's `BatchedEngine` once, and for each workload of the spec runs the warm-up pass,
then the workload: closed loop as one asyncio task per client (each awaiting its requests in turn),
open loop as a task per request started at its arrival time. TTFT is the first streamed output
that carries a completion token. EOS is masked by a logits processor (vllm-mlx has no ignore_eos).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import sys
import time
from typing import Any, Optional


def _preload_blas(path: Optional[str]) -> None:
    # Same mechanism as mlxq's worker.platform: RTLD_GLOBAL before mlx is first imported.
    if path:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


class MaskEos:
    """Adds -1e9 to the EOS logits. Built lazily on the engine's own thread (MLX arrays are tied
    to the stream of the thread that made them)."""

    def __init__(self, eos_ids: list[int]) -> None:
        self.eos_ids = eos_ids
        self.bias: Any = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        if self.bias is None or self.bias.shape[-1] != logits.shape[-1]:
            import numpy as np

            bias = np.zeros(logits.shape[-1], dtype=np.float32)
            bias[[t for t in self.eos_ids if t < logits.shape[-1]]] = -1e9
            self.bias = mx.array(bias)
        return logits + self.bias.astype(logits.dtype)


async def _one(engine: Any, request: dict[str, Any], arrival: float, t0: float, mask: MaskEos,
               records: list[dict[str, Any]]) -> float:
    record: dict[str, Any] = {"index": request["index"], "arrival": arrival, "started": None,
                              "first_token": None, "finished": None, "tokens": 0, "error": None}
    try:
        last, text = None, []
        async for output in engine.stream_generate(prompt=request["ids"], max_tokens=request["max_tokens"],
                                                   temperature=0.0, top_p=1.0, logits_processors=[mask]):
            if record["first_token"] is None and output.completion_tokens > 0:
                record["first_token"] = time.perf_counter() - t0
            last = output
            text.append(output.new_text or "")  # `text` is stripped of whitespace and special tokens
        record["finished"] = time.perf_counter() - t0
        record["tokens"] = last.completion_tokens if last is not None else 0
        record["text"] = "".join(text)
    except Exception as exc:  # recorded as a failed request
        record["error"] = f"{type(exc).__name__}: {exc}"[:200]
    records.append(record)
    return record["finished"] if record["finished"] is not None else time.perf_counter() - t0


async def _run(engine: Any, workload: dict[str, Any], mask: MaskEos, timeout: float) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if workload["kind"] == "closed":
        clients: dict[int, list[dict[str, Any]]] = {}
        for request in workload["requests"]:
            clients.setdefault(request["client"], []).append(request)

        async def client(queue: list[dict[str, Any]]) -> None:
            arrival = 0.0
            for request in queue:
                arrival = await _one(engine, request, arrival, t0, mask, records)

        await asyncio.wait_for(asyncio.gather(*(client(q) for q in clients.values())), timeout)
    else:
        tasks = []
        for request in sorted(workload["requests"], key=lambda r: r["arrival_s"]):
            await asyncio.sleep(max(0.0, request["arrival_s"] - (time.perf_counter() - t0)))
            tasks.append(asyncio.ensure_future(_one(engine, request, request["arrival_s"], t0, mask, records)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    return records


def _versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    found: dict[str, Optional[str]] = {}
    for name in ("vllm-mlx", "mlx", "mlx-lm", "transformers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _blas_loaded(path: Optional[str]) -> Optional[bool]:
    if not path or not sys.platform.startswith("linux"):
        return None
    with open("/proc/self/maps") as maps:
        text = maps.read()
    return os.path.realpath(path) in text or path in text


async def main_async(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm_mlx.engine.batched import BatchedEngine
    from vllm_mlx.scheduler import SchedulerConfig

    config = SchedulerConfig(max_num_seqs=spec["max_num_seqs"], completion_batch_size=spec["max_num_seqs"],
                             prefill_batch_size=min(spec["prefill_batch_size"], spec["max_num_seqs"]))
    engine = BatchedEngine(spec["model"], scheduler_config=config)
    await engine.start()
    tokenizer = engine.tokenizer
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    mask = MaskEos(sorted(eos))
    results = []
    try:
        for item in spec["plan"]:
            try:
                if item.get("warmup"):
                    await _run(engine, item["warmup"], mask, spec["timeout_s"])
                records = await _run(engine, item["workload"], mask, spec["timeout_s"])
                results.append({"label": item["label"], "records": records, "error": None})
            except Exception as exc:
                results.append({"label": item["label"], "records": [], "error": f"{type(exc).__name__}: {exc}"})
    finally:
        await engine.stop()
    return {"versions": _versions(), "blas_loaded": _blas_loaded(spec.get("blas_path")),
            "scheduler_config": {"max_num_seqs": config.max_num_seqs, "completion_batch_size":
                                 config.completion_batch_size, "prefill_batch_size": config.prefill_batch_size,
                                 "enable_prefix_cache": config.enable_prefix_cache},
            "eos_masked": sorted(eos), "results": results}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    _preload_blas(spec.get("blas_path"))
    logging.basicConfig(level=logging.WARNING)
    for name in ("vllm_mlx", "vllm_mlx.engine_core", "vllm_mlx.scheduler"):
        logging.getLogger(name).setLevel(logging.WARNING)
    output = asyncio.run(main_async(spec))
    with open(out_path, "w") as f:
        json.dump(output, f)


if __name__ == "__main__":
    main()
