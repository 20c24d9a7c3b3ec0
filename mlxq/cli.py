"""The `mlxq` command line. Each verb is a thin wrapper; the work lives in the packages."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from mlxq import api_command, batch_command, control_commands, info, producer_commands
from mlxq.producer_commands import URL_PASSWORD_NOTE
from producer.wire import DEFAULT_URL, resolve_url
from mlxq.bench import cli as bench_cli

if TYPE_CHECKING:
    from worker.settings import WorkerSettings

def cmd_worker(args: argparse.Namespace) -> int:
    if args.blas:
        os.environ["MLXQ_BLAS"] = args.blas  # read when `worker` is first imported, before MLX
    import redis

    from worker import BatchWorker, WorkerSettings

    settings = WorkerSettings.from_env(
        model=args.model,
        alias=args.alias,
        max_num_seqs=args.max_num_seqs,
        default_max_tokens=args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        prefix_cache_mb=args.prefix_cache_mb,
        decode=args.decode,
        metrics_port=args.metrics_port,
        blas=args.blas,
        blas_threads=args.blas_threads,
        metal_wired_limit_mb=args.metal_wired_limit_mb,
        metal_cache_limit_mb=args.metal_cache_limit_mb,
        priorities=tuple(p.strip() for p in args.priorities.split(",") if p.strip()) if args.priorities else None,
        image_dir=args.image_dir,
    )
    logging.getLogger("mlxq").setLevel(args.log_level)  # rq's bootstrap sets its own loggers only
    processes = _processes(args)
    if processes > 1:
        return _run_worker_group(args, settings, processes)
    from worker.loading import ModelLoadError, check_model_setting

    try:
        if settings.engine != "fake":
            check_model_setting(settings.model)
        connection = redis.Redis.from_url(resolve_url(args.url))
        worker = BatchWorker(args.queues or None, connection=connection, settings=settings, name=args.name)
        worker.work(burst=args.burst, logging_level=args.log_level, max_jobs=args.max_jobs)
    except ModelLoadError as exc:
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 1
    return 0


def _processes(args: argparse.Namespace) -> int:
    if args.processes is not None:
        return int(args.processes)
    raw = os.environ.get("MLXQ_PROCESSES", "").strip()
    try:
        return int(raw) if raw else 1
    except ValueError:
        raise SystemExit(f"MLXQ_PROCESSES: cannot parse {raw!r} as an integer") from None


def _run_worker_group(args: argparse.Namespace, settings: WorkerSettings, processes: int) -> int:
    from worker.platform import preload_blas
    from worker.process_group import WorkerGroup, child_settings

    try:
        shares = child_settings(settings, processes, os.cpu_count() or 1,
                                split_blas_threads=preload_blas(settings.blas).path is not None,
                                group=args.name or f"{socket.gethostname()}.{os.getpid()}")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    worker_args = ["--log-level", args.log_level, *(["--burst"] if args.burst else []),
                   *(["--max-jobs", str(args.max_jobs)] if args.max_jobs is not None else []),
                   *(["--", *args.queues] if args.queues else [])]
    return WorkerGroup(shares, resolve_url(args.url), worker_args, name=args.name).run()


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    import worker  # noqa: F401  (BLAS preload before MLX)
    from worker.tiny_model import make_tiny_model, make_tiny_vision_model

    if args.vision:
        path = make_tiny_vision_model(args.path, shape=args.shape, seed=args.seed)
    else:
        path = make_tiny_model(args.path, shape=args.shape, dtype=args.dtype, seed=args.seed, arch=args.arch)
    print(path)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mlxq.demo import run_demo

    return run_demo(
        url=args.url or os.environ.get("MLXQ_REDIS_URL"),
        model=args.model,
        jobs=args.jobs,
        threads=args.threads,
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
        vision=args.vision,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxq", description="Redis/RQ-queued batch inference on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run a continuous-batching worker", description=(
        "Run a BatchWorker. Without queues it listens on mlxq:<alias> then mlxq. "
        "Every flag has an MLXQ_* environment variable twin (e.g. MLXQ_MAX_NUM_SEQS)."))
    p.add_argument("queues", nargs="*", help="queues to listen on, in priority order")
    p.add_argument("--url", help=f"Redis URL (default: $MLXQ_REDIS_URL or {DEFAULT_URL}; {URL_PASSWORD_NOTE})")
    p.add_argument("--model", help="model path or hub id (MLXQ_MODEL)")
    p.add_argument("--alias", help="name requests use for this model (default: last path component)")
    p.add_argument("--priorities", help=(
        "priorities, highest first, e.g. high,default,low (MLXQ_PRIORITIES): without queues, listen on each "
        "priority's queues in turn (mlxq:<alias>@high, mlxq@high, mlxq:<alias>, mlxq, ...)"))
    p.add_argument("--max-num-seqs", type=int, help="most sequences decoding at once (default 32)")
    p.add_argument("--default-max-tokens", type=int, help="max_tokens for requests that leave it unset (256)")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask for (4096)")
    p.add_argument("--max-prompt-tokens", type=int, help="longest prompt in tokens (32768)")
    p.add_argument("--prefix-cache-mb", type=int,
                   help="memory for KV caches of prompts reused across jobs; 0 turns it off (default 1024)")
    p.add_argument("--decode", choices=("auto", "compiled", "batch-generator"),
                   help="decode path (MLXQ_DECODE; default auto: mlxq's compiled engine where it is exact)")
    p.add_argument("--metrics-port", type=int, help=(
        "serve Prometheus metrics on this port (MLXQ_METRICS_PORT); with --processes N, process i on port + i"))
    p.add_argument("--blas", help="Linux CPU: auto | off | path to a BLAS library (default auto: OpenBLAS)")
    p.add_argument("--blas-threads", type=int,
                   help="Linux CPU: that BLAS's threads (default one per core; several workers a host: a share each)")
    p.add_argument("--metal-wired-limit-mb", type=int, help="macOS: Metal wired memory limit")
    p.add_argument("--metal-cache-limit-mb", type=int, help="macOS: Metal buffer cache limit")
    p.add_argument("--image-dir", help="vision models: the one folder image paths in requests may name (MLXQ_IMAGE_DIR)")
    p.add_argument("--processes", type=int, help=(
        "worker processes on this host (default 1). Above 1, --max-num-seqs, --prefix-cache-mb, "
        "--blas-threads and MLXQ_KV_BUDGET_MB are the host's totals, shared out; --max-jobs is per process"))
    p.add_argument("--name", help="worker name (default: RQ's; with --processes, NAME-1, NAME-2, ...)")
    p.add_argument("--burst", action="store_true", help="quit when the queues are empty")
    p.add_argument("--max-jobs", type=int, help="quit after taking this many jobs")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("make-tiny-model", help="build a small random-weight model directory (offline)")
    p.add_argument("path")
    p.add_argument("--shape", default="tiny", help="tiny | smollm-135m | qwen2.5-0.5b (with --vision: tiny | small)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="llama", help="llama | mistral | qwen2 | qwen3 | gemma | gemma2 | gemma3_text")
    p.add_argument("--vision", action="store_true", help="a qwen2_vl vision-language model (images and text)")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="the whole pipeline on this machine, with embedded defaults")
    p.add_argument("--url", help=f"use this Redis instead of starting a private one ({URL_PASSWORD_NOTE})")
    p.add_argument("--model", help="use this model instead of building the tiny one")
    p.add_argument("--jobs", type=int, default=48)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--vision", action="store_true",
                   help="image jobs (generated pictures) and text jobs on a tiny vision-language model")
    p.set_defaults(func=cmd_demo)

    producer_commands.register(sub)
    control_commands.register(sub)
    batch_command.register(sub)
    api_command.register(sub)
    bench_cli.register(sub)
    info.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
