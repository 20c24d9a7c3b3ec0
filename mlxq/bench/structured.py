"""`mlxq bench --scenario structured`: the decode step with half the rows under a JSON-schema
constraint against the same batch all free (docs/structured-output.md).

mlxq's BatchScheduler and TextEngine run in this process (as arm S), --max-num-seqs rows at once,
prefilled in one batch, greedy, --prompt-tokens prompts. Free rows ignore EOS; constrained rows follow a schema whose shortest
document is longer than --new-tokens, so no row ends inside the measured window: the steps after
every row has its first token, up to the last. The two batches run in turn, --repeats times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mlxq.bench.config import BenchConfig

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "price": {"type": "number", "minimum": 0},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "price", "ok"],
    "additionalProperties": False,
}


def _schema(new_tokens: int) -> dict[str, Any]:
    # Each item takes at least ~20 tokens: enough items that the document cannot close in time.
    return {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": new_tokens // 4}},
            "required": ["items"], "additionalProperties": False}


def _requests(cfg: BenchConfig, rows: int, constrained: int, tag: str) -> dict[str, dict[str, Any]]:
    schema = {"type": "json_schema", "json_schema": {"name": "items", "schema": _schema(cfg.new_tokens)}}
    requests = {}
    for i in range(rows):
        prompt = [(i * 37 + k * 11) % 4000 + 10 for k in range(cfg.prompt_tokens)]
        request: dict[str, Any] = {"prompt_token_ids": prompt, "max_tokens": cfg.new_tokens, "temperature": 0}
        if i % 2 == 1 and constrained > i // 2:  # constrained rows interleaved with free ones
            request["response_format"] = schema
        else:
            request["ignore_eos"] = True
        requests[f"{tag}-{i}"] = request
    return requests


class _CountingEngine:
    """The engine as the scheduler sees it, counting the tokens of its last step."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.last_events = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[Any]:
        events = self._engine.step()
        self.last_events = len(events)
        return events


def _step_times(scheduler: Any, engine: _CountingEngine, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each step's time while every row decodes (a token from each, none ending), and how rows ended."""
    for job_id, payload in requests.items():
        failed = scheduler.admit(job_id, payload)
        if failed is not None:
            raise RuntimeError(f"{job_id}: {failed.error}")
    times, lengths = [], []
    while len(scheduler):
        started = time.perf_counter()
        ended = scheduler.step()
        elapsed = time.perf_counter() - started
        if engine.last_events == len(requests) and not ended:
            times.append(elapsed * 1e3)
        lengths += [len(end.result().choices[0].token_ids) for end in ended]
    return {"step_ms": times, "lengths": lengths}


def structured(cfg: BenchConfig, model_path: str, decode: str = "auto") -> dict[str, Any]:
    """`decode`: the worker's setting of that name; "auto" measures the engine a worker would pick."""
    import mlx.core as mx
    from mlx_lm import load

    from worker.loading import engine_for_model
    from worker.batch_loop import GIL_SWITCH_INTERVAL_S
    from worker.scheduler import BatchScheduler
    from worker.settings import WorkerSettings

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as the worker's loop runs its steps
    rows = cfg.max_num_seqs
    model, tokenizer = load(model_path)
    if cfg.weights == "worker":  # as a worker serves it on this device
        from worker.weight_prep import prepare_weights

        prepare_weights(model)
    # Every prompt in one prefill batch, so that all rows decode together for the whole window.
    settings = WorkerSettings(max_num_seqs=rows, prefill_batch_size=rows, prefix_cache_mb=0, decode=decode,
                              decode_warmup_tokens=0)
    text_engine = engine_for_model(settings, model, tokenizer)
    engine = _CountingEngine(text_engine)
    scheduler = BatchScheduler(engine, max_num_seqs=rows, default_max_tokens=cfg.new_tokens)  # type: ignore[arg-type]
    arms = {"free": 0, "half": rows // 2}
    _step_times(scheduler, engine, _requests(cfg, rows, rows // 2, "warmup"))  # compiles every shape
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for repeat in range(cfg.repeats):
        for name, constrained in arms.items():
            mx.clear_cache()
            run = _step_times(scheduler, engine, _requests(cfg, rows, constrained, f"{name}{repeat}"))
            lengths = set(run["lengths"])
            if lengths != {cfg.new_tokens}:
                raise RuntimeError(f"{name}: rows ended early ({sorted(lengths)}); the window is not all rows")
            runs[name].append({"step_p50_ms": statistics.median(run["step_ms"]), "steps": len(run["step_ms"])})
    ratios = [h["step_p50_ms"] / f["step_p50_ms"] for h, f in zip(runs["half"], runs["free"])]
    return {"rows": rows, "constrained_rows": rows // 2, "new_tokens": cfg.new_tokens,
            "engine": type(text_engine).__name__,
            "vocab_size": text_engine.vocab_size, "runs": runs, "half_over_free": ratios,
            "half_over_free_median": statistics.median(ratios), "check": _check(scheduler, rows)}


CHECK_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "ok": {"type": "boolean"}},
                "required": ["id", "ok"], "additionalProperties": False}


def _check(scheduler: Any, rows: int) -> dict[str, int]:
    """On this machine's backend: the rows of a short schema that finished are documents of it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "check", "schema": CHECK_SCHEMA}}
    for i in range(rows):
        scheduler.admit(f"check-{i}", {"prompt_token_ids": [i % 900 + 10, 7, 8], "max_tokens": 24,
                                       "temperature": 1.0, "seed": i, "response_format": fmt})
    counts = {"finished": 0, "valid": 0, "length": 0}
    while len(scheduler):
        for end in scheduler.step():
            choice = end.result().choices[0]
            if choice.finish_reason != "stop":
                counts["length"] += 1
                continue
            counts["finished"] += 1
            document = json.loads(choice.text)
            if set(document) == {"id", "ok"} and isinstance(document["ok"], bool) and 0 <= document["id"] <= 999:
                counts["valid"] += 1
    return counts


def summary_line(s: dict[str, Any]) -> str:
    free = statistics.median(r["step_p50_ms"] for r in s["runs"]["free"])
    half = statistics.median(r["step_p50_ms"] for r in s["runs"]["half"])
    return (f"- structured ({s.get('engine', 'TextEngine')}, {s['rows']} rows, {s['constrained_rows']} under a JSON "
            f"schema, vocab {s['vocab_size']}): "
            f"decode step {half:.2f} ms against {free:.2f} ms all free; half/free "
            f"{s['half_over_free_median']:.3f} (median of {len(s['half_over_free'])} repeats' ratios)")


def main() -> None:
    """Run the scenario alone, without the bench's Redis: `python -m mlxq.bench.structured --model DIR`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode", default="auto", choices=("auto", "compiled", "batch-generator"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = BenchConfig(out=args.out, max_num_seqs=args.max_num_seqs, prompt_tokens=args.prompt_tokens,
                      new_tokens=args.new_tokens, repeats=args.repeats)
    import mlx.core as mx

    report = {"command": "python -m mlxq.bench.structured " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
              "device": str(mx.default_device()), "structured": structured(cfg, args.model, args.decode)}
    args.out.write_text(json.dumps(report, indent=1))
    print(summary_line(report["structured"]))
    print("check:", report["structured"]["check"])


if __name__ == "__main__":
    import worker  # noqa: F401  (points MLX at OpenBLAS before it loads, on Linux)

    main()
