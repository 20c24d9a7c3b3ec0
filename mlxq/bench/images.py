"""`mlxq bench --scenario images`: image jobs on a vision-language model, side by side in one run:

- alone: each request on its own through mlx-vlm's `generate_step`, one after the other (the model
  loaded once, in this process);
- mlx-vlm batched: mlx-vlm's own `BatchGenerator` with every request inserted up front (greedy, no
  logprobs, no queue: its engine bound);
- mlxq: the same requests submitted at once to one `mlxq worker` process serving the model, through
  Redis, then again with logprobs and top-5 logprobs on every token.
With --repeats R the four run in turn R times; the ratios are medians of each repeat's own.
Every arm starts from the same request payloads (data URLs of pictures drawn here) and spends its
own time decoding them and running the model's processor (worker/engines/vision.py `prepare`). All
sample greedily and never stop on EOS, so each request yields exactly `image_new_tokens` tokens and
the arms' token ids can be compared.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from mlxq.bench.arm_mlxq import MlxqCluster, drive
from mlxq.bench.config import BenchConfig
from mlxq.bench.procs import ProcessSet, model_facts
from mlxq.bench.stats import median, ratio, summarize
from mlxq.bench.workloads import BenchRequest, Prompt, RequestRecord, Workload, all_at_once


def image_payloads(count: int, new_tokens: int, salt: int = 0) -> list[dict[str, Any]]:
    """`count` chat requests of one generated picture each (sizes vary, so do their image tokens)."""
    return [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _picture(i + salt)}},
        {"type": "text", "text": f"Describe picture {i + salt} in detail."}]}],
        "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True} for i in range(count)]


def _picture(i: int) -> str:
    from PIL import Image, ImageDraw

    width, height = 112 + 28 * (i % 5), 112 + 28 * ((i // 5) % 4)
    image = Image.radial_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for k in range(3):
        x, y = (37 * (i + k)) % width, (53 * (i + 3 * k)) % height
        draw.rectangle((x, y, x + 24, y + 16), fill=((70 * i) % 256, (110 * k) % 256, (30 * i + 90) % 256))
    out = io.BytesIO()
    image.save(out, "PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def image_model(cfg: BenchConfig) -> tuple[str, dict[str, Any]]:
    if cfg.image_model:
        return cfg.image_model, {"path": cfg.image_model, "source": cfg.image_model}
    root = cfg.model_cache or Path.home() / ".cache" / "mlxq" / "bench-models"
    path = root / f"vision-{cfg.image_shape}"
    if not (path / "config.json").exists():
        print(f"building the random-weight {cfg.image_shape} vision model in {path} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "mlxq", "make-tiny-model", "--vision", "--shape", cfg.image_shape,
                        str(path)], check=True, stdout=subprocess.DEVNULL)
    return str(path), {"path": str(path), "source": f"random weights, {cfg.image_shape} qwen2_vl shape "
                                                     "(mlxq make-tiny-model --vision)"}


class _LocalVlm:
    """The model in this process, and the engine whose `prepare` every local arm uses."""

    def __init__(self, path: str, cfg: BenchConfig) -> None:
        from mlx_vlm import load

        from worker.engines.vision import VisionEngine

        self.model, self.processor = load(path)
        self.engine = VisionEngine(self.model, self.processor, max_num_seqs=cfg.max_num_seqs,
                                   prefill_batch_size=cfg.prefill_batch_size)

    def prepare(self, payload: dict[str, Any]) -> Any:
        from schemas import GenerationRequest

        return self.engine.prepare(GenerationRequest.validate_payload(payload))


def run_alone(vlm: _LocalVlm, payloads: list[dict[str, Any]]) -> tuple[list[RequestRecord], list[list[int]]]:
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    records, outputs = [], []
    t0 = time.perf_counter()
    for i, payload in enumerate(payloads):
        record = RequestRecord(i, 0.0, started=time.perf_counter() - t0)
        prompt = vlm.prepare(payload)
        kwargs = {"image_grid_thw": prompt.inputs.image_grid_thw} if prompt.inputs is not None else {}
        steps = generate_step(mx.array([prompt.token_ids]), vlm.model,
                              prompt.inputs.pixel_values if prompt.inputs is not None else None, None,
                              max_tokens=payload["max_tokens"], sampler=lambda x: mx.argmax(x, axis=-1), **kwargs)
        tokens = []
        for token, _ in steps:
            if not tokens:
                record.first_token = time.perf_counter() - t0
            tokens.append(int(token))
        record.finished, record.tokens = time.perf_counter() - t0, len(tokens)
        records.append(record)
        outputs.append(tokens)
    return records, outputs


def run_batched(vlm: _LocalVlm, payloads: list[dict[str, Any]], cfg: BenchConfig
                ) -> tuple[list[RequestRecord], list[list[int]]]:
    import mlx.core as mx
    from mlx_vlm.generate import BatchGenerator

    from worker.engines.vision import NoBatchStop

    generator = BatchGenerator(vlm.model.language_model, NoBatchStop(), completion_batch_size=cfg.max_num_seqs,
                               prefill_batch_size=cfg.prefill_batch_size, compute_logprobs=False)
    t0 = time.perf_counter()
    records = [RequestRecord(i, 0.0, started=0.0) for i in range(len(payloads))]
    outputs: list[list[int]] = [[] for _ in payloads]
    by_uid: dict[int, int] = {}
    for i, payload in enumerate(payloads):
        prompt = vlm.prepare(payload)
        inputs = prompt.inputs
        embedded = vlm.model.get_input_embeddings(mx.array([prompt.token_ids]), inputs.pixel_values,
                                                  image_grid_thw=inputs.image_grid_thw)
        kwargs = {k: v for k, v in embedded.to_dict().items() if v is not None}
        (uid,) = generator.insert([prompt.token_ids], max_tokens=payload["max_tokens"], prompt_kwargs=[kwargs])
        by_uid[uid] = i
    while generator.has_work:
        _, responses = generator.next()
        now = time.perf_counter() - t0
        for response in responses:
            i = by_uid[response.uid]
            if not outputs[i]:
                records[i].first_token = now
            outputs[i].append(int(response.token))
            if response.finish_reason is not None:
                records[i].finished, records[i].tokens = now, len(outputs[i])
    generator.close()
    return records, outputs


def run_mlxq(cluster: MlxqCluster, payloads: list[dict[str, Any]], label: str, timeout_s: float
             ) -> tuple[dict[str, Any], list[list[int]]]:
    workload = _workload(payloads, label)
    records = drive(cluster, workload, timeout_s, make_payload=lambda r: payloads[r.index])
    assert cluster.client is not None
    results = cluster.client.wait_many([r.extra["job_id"] for r in records], timeout=60)
    outputs = [results[r.extra["job_id"]].choices[0].token_ids if results[r.extra["job_id"]].choices else []
               for r in records]
    return summarize(workload, records), outputs


def _workload(payloads: list[dict[str, Any]], label: str) -> Workload:
    return all_at_once([BenchRequest(i, Prompt("", ()), p["max_tokens"]) for i, p in enumerate(payloads)], label)


def images(cfg: BenchConfig, url: str, procs: ProcessSet, blas_path: Optional[str]) -> dict[str, Any]:
    """The arms in turn, `cfg.repeats` times over (alone, batched, mlxq, mlxq with logprobs, then
    again): ratios are the medians of each repeat's own, so drift on a shared machine hits every
    arm of a repeat alike."""
    path, source = image_model(cfg)
    payloads = image_payloads(cfg.image_requests, cfg.image_new_tokens)
    with_logprobs = [{**p, "logprobs": True, "top_logprobs": 5} for p in payloads]
    warmup = image_payloads(min(8, cfg.image_requests), cfg.warmup_tokens, salt=10_000)
    workload = _workload(payloads, "images")
    vlm = _LocalVlm(path, cfg)
    prompts = [vlm.prepare(p) for p in payloads]
    image_token = int(vlm.model.config.image_token_id)
    cluster = MlxqCluster(url, path, 1, cfg.max_num_seqs, cfg.prefill_batch_size, procs, blas_path=blas_path)
    cluster.start()
    repeats: list[dict[str, Any]] = []
    try:
        run_alone(vlm, warmup)
        run_batched(vlm, warmup, cfg)
        run_mlxq(cluster, warmup, "images-warmup", cfg.request_timeout_s)
        for repeat in range(cfg.repeats):
            print(f"   repeat {repeat + 1} of {cfg.repeats}: alone, mlx-vlm batched, mlxq, mlxq with logprobs",
                  flush=True)
            alone_records, alone_ids = run_alone(vlm, payloads)
            batched_records, batched_ids = run_batched(vlm, payloads, cfg)
            before = cluster.time_counters()
            mlxq, mlxq_ids = run_mlxq(cluster, payloads, "images", cfg.request_timeout_s)
            after = cluster.time_counters()
            mlxq_lp, mlxq_lp_ids = run_mlxq(cluster, with_logprobs, "images-logprobs", cfg.request_timeout_s)
            runs = {"alone": summarize(workload, alone_records), "mlx_vlm_batched": summarize(workload, batched_records),
                    "mlxq": mlxq, "mlxq_logprobs": mlxq_lp}
            outputs = {"mlx_vlm_batched": batched_ids, "mlxq": mlxq_ids, "mlxq_logprobs": mlxq_lp_ids}
            for arm, ids in outputs.items():
                runs[arm]["same_token_ids_as_alone"] = sum(a == b for a, b in zip(alone_ids, ids))
            runs["mlxq"]["engine_s"] = {name: after[name] - before.get(name, 0.0) for name in after
                                        if name in ("engine_vision_s", "engine_prefill_s", "engine_decode_s")}
            repeats.append(runs)
    finally:
        cluster.stop()

    def ratios(numerator: str, denominator: str) -> list[Optional[float]]:
        return [ratio(r[numerator]["tokens_per_s"], r[denominator]["tokens_per_s"]) for r in repeats]

    per_repeat = {"mlxq_over_alone": ratios("mlxq", "alone"),
                  "mlxq_over_mlx_vlm_batched": ratios("mlxq", "mlx_vlm_batched"),
                  "mlxq_logprobs_over_mlxq": ratios("mlxq_logprobs", "mlxq")}
    return {
        "model": {**source, "facts": model_facts(path)},
        "requests": cfg.image_requests, "new_tokens": cfg.image_new_tokens, "repeats": repeats,
        "max_num_seqs": cfg.max_num_seqs, "prefill_batch_size": cfg.prefill_batch_size,
        "prompt_tokens": _spread([len(p.token_ids) for p in prompts]),
        "image_tokens": _spread([p.token_ids.count(image_token) for p in prompts]),
        "tokens_per_s": {arm: median([r[arm]["tokens_per_s"] for r in repeats]) for arm in repeats[0]},
        "ratios": {name: median(values) for name, values in per_repeat.items()},
        "ratios_per_repeat": per_repeat,
        "same_token_ids_as_alone": {arm: min(r[arm]["same_token_ids_as_alone"] for r in repeats)
                                    for arm in ("mlx_vlm_batched", "mlxq", "mlxq_logprobs")},
    }


def _spread(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}


def images_line(s: dict[str, Any]) -> str:
    def x(value: Optional[float]) -> str:
        return f"{value:.2f}x" if value is not None else "n/a"

    tps, same, r = s["tokens_per_s"], s["same_token_ids_as_alone"], s["ratios"]
    repeats = f", medians of {len(s['repeats'])} repeats" if len(s["repeats"]) > 1 else ""
    return (f"- images ({s['requests']} image jobs at once, {s['new_tokens']} new tokens each, "
            f"{s['image_tokens']['min']:.0f}-{s['image_tokens']['max']:.0f} image tokens{repeats}): alone "
            f"{_f(tps['alone'])} tok/s, mlx-vlm batched {_f(tps['mlx_vlm_batched'])}, mlxq {_f(tps['mlxq'])} "
            f"({x(r['mlxq_over_alone'])} alone, {x(r['mlxq_over_mlx_vlm_batched'])} mlx-vlm batched), mlxq with "
            f"logprobs {_f(tps['mlxq_logprobs'])} ({x(r['mlxq_logprobs_over_mlxq'])}); token ids as alone: mlx-vlm "
            f"batched {same['mlx_vlm_batched']}, mlxq {same['mlxq']}, with logprobs {same['mlxq_logprobs']} "
            f"of {s['requests']}")


def _f(value: Optional[float]) -> str:
    return f"{value:.1f}" if value is not None else "n/a"
