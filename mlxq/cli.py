"""The `mlxq` command line. Each verb is a thin wrapper; the work lives in the packages."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from mlxq import api_command, batch_command, control_commands, info, producer_commands, real_model, stats_command
from mlxq.producer_commands import URL_PASSWORD_NOTE
from producer.wire import DEFAULT_URL, resolve_url
from mlxq.bench import cli as bench_cli

if TYPE_CHECKING:
    from worker.settings import WorkerSettings

def cmd_worker(args: argparse.Namespace) -> int:
    blas = args.blas or os.environ.get("MLXQ_BLAS") or _dotenv_value("MLXQ_BLAS")
    if blas:
        os.environ["MLXQ_BLAS"] = blas  # read when `worker` is first imported, before MLX
    from schemas import broker
    from worker import BatchWorker
    from worker.settings import SettingsError, WorkerSettings

    flags = vars(args)
    try:  # a flag given beats MLXQ_* and .env; each flag's dest is its setting's name
        settings = WorkerSettings.from_env(**{name: flags[name] for name in WorkerSettings.model_fields if name in flags})
    except SettingsError as exc:
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("mlxq").setLevel(args.log_level)  # rq's bootstrap sets its own loggers only
    url = args.url or settings.redis_url_value or resolve_url(None)
    if settings.processes > 1:
        return _run_worker_group(args, settings, url)
    from worker.engines.device_loss import DEVICE_LOST_EXIT_CODE, DeviceLost
    from worker.loading import ModelLoadError, check_model_setting

    try:
        if settings.engine != "fake":
            check_model_setting(settings.model)
        connection = broker.connect(url)
        worker = BatchWorker(args.queues or None, connection=connection, settings=settings, name=args.name)
        worker.work(burst=args.burst, logging_level=args.log_level, max_jobs=args.max_jobs)
    except ModelLoadError as exc:
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 1
    except DeviceLost as exc:
        print(f"mlxq worker: the device failed; its jobs went back to their queues: {exc}", file=sys.stderr)
        return DEVICE_LOST_EXIT_CODE
    return 0


def _dotenv_value(name: str) -> Optional[str]:
    """`name` from the working directory's .env file, as WorkerSettings reads it."""
    from dotenv import dotenv_values

    return dotenv_values(".env").get(name) if os.path.exists(".env") else None


def _run_worker_group(args: argparse.Namespace, settings: WorkerSettings, url: str) -> int:
    from worker.platform import preload_blas
    from worker.process_group import WorkerGroup, child_settings

    try:
        shares = child_settings(settings, settings.processes, os.cpu_count() or 1,
                                split_blas_threads=preload_blas(settings.blas).path is not None,
                                group=args.name or f"{socket.gethostname()}.{os.getpid()}")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    worker_args = ["--log-level", args.log_level, *(["--burst"] if args.burst else []),
                   *(["--max-jobs", str(args.max_jobs)] if args.max_jobs is not None else []),
                   *(["--", *args.queues] if args.queues else [])]
    return WorkerGroup(shares, url, worker_args, name=args.name).run()


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    import worker  # noqa: F401  (BLAS preload before MLX)
    from worker.tiny_model import make_tiny_model, make_tiny_vision_model

    if args.vision:
        path = make_tiny_vision_model(args.path, shape=args.shape, seed=args.seed)
    else:
        path = make_tiny_model(args.path, shape=args.shape, dtype=args.dtype, seed=args.seed, arch=args.arch,
                               tokenizer_from=args.tokenizer_from)
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
        tiny=args.tiny,
    )


def _add_more_worker_flags(p: argparse.ArgumentParser) -> None:
    """The settings' flags not listed above; each is its MLXQ_* variable's twin (worker/settings.py)."""
    p.add_argument("--kv-budget-mb", type=int, help="KV-cache memory for admission (default: half the RAM)")
    p.add_argument("--max-job-bytes", type=int, help="a job hash bigger than this fails unread (16 MiB)")
    p.add_argument("--prefill-batch-size", type=int, help="prompts prefilled together (8)")
    p.add_argument("--prefill-step-size", type=int, help="prompt tokens per prefill step (2048)")
    p.add_argument("--heartbeat-interval-s", type=float, help="job heartbeats this often; TTL 3x + 5 s (5)")
    p.add_argument("--step-timeout-s", type=float, help="a step longer than this exits the process (300)")
    p.add_argument("--sweep-interval-s", type=float, help="how often dead workers' jobs are recovered (15)")
    p.add_argument("--stop-grace-s", type=float, help="a stopping worker waits this long for an unreachable Redis (30)")
    p.add_argument("--engine", help="mlx | fake (model-free, deterministic: tests and queue benchmarks)")
    p.add_argument("--tool-call-format", help="tool calls parsed and forced in: auto (from the chat template), "
                   "hermes, llama3_json, mistral, or an mlx-lm tool parser (docs/tools.md)")
    p.add_argument("--reasoning", help="auto (split a thinking model's reasoning from its answer) | none")
    p.add_argument("--fake-step-delay-s", type=float, help="the fake engine's cost per step (0)")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model's own code run when it is loaded (off)")
    p.add_argument("--callback-allowlist", help="RQ callback name prefixes allowed to run, comma-separated (none)")
    p.add_argument("--max-retries", type=int, help="a failed job runs again at most this many times (5)")
    p.add_argument("--retry-backoff-s", type=float, help="pause before the first retry, doubled each time (1)")
    p.add_argument("--group", help="processes that share waiting jobs out (set by --processes)")
    p.add_argument("--durable-results", type=int,
                   help="replicas that must have a result (Redis WAIT) before it is announced (0: none)")
    p.add_argument("--durable-timeout-ms", type=int, help="how long each such WAIT waits (2000)")
    g = p.add_argument_group("images (vision-language models, docs/images.md)")
    g.add_argument("--image-dir", help="the one folder image paths in requests may name (MLXQ_IMAGE_DIR)")
    g.add_argument("--max-images", type=int, help="image parts per request (8)")
    g.add_argument("--max-image-bytes", type=int, help="an image's encoded size, from any source (10 MiB)")
    g.add_argument("--max-image-pixels", type=int, help="width x height, read from the header before decoding")
    g.add_argument("--image-fetch", action=argparse.BooleanOptionalAction, default=None,
                   help="fetch http(s) image URLs (off: such a request fails)")
    g.add_argument("--image-fetch-timeout-s", type=float, help="seconds a fetch may take")
    g.add_argument("--image-fetch-max-redirects", type=int, help="redirects a fetch may follow")
    g.add_argument("--image-fetch-allow-nets", help="networks a fetch may reach beside public addresses, as CIDRs "
                   "separated by commas (an internal image store)")
    g.add_argument("--image-io-threads", type=int, help="image inputs read from files or fetched at once (16)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxq", description="Redis/RQ-queued batch inference on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run a continuous-batching worker", description=(
        "Run a BatchWorker. Without queues it listens on mlxq:<alias> then mlxq. "
        "Every flag has an MLXQ_* environment variable twin (e.g. MLXQ_MAX_NUM_SEQS), which a .env file in "
        "the working directory may set too; a flag beats the variable, the variable beats .env."))
    p.add_argument("queues", nargs="*", help="queues to listen on, in priority order")
    p.add_argument("--url", help=f"Redis URL (default: $MLXQ_REDIS_URL or {DEFAULT_URL}; {URL_PASSWORD_NOTE})")
    p.add_argument("--model", help="model directory, .gguf file (F32, F16, Q4_0, Q4_1, Q8_0) or hub id (MLXQ_MODEL)")
    p.add_argument("--alias", help="name requests use for this model (default: last path component; a .gguf's stem)")
    p.add_argument("--priorities", help=(
        "priorities, highest first, e.g. high,default,low (MLXQ_PRIORITIES): without queues, listen on each "
        "priority's queues in turn (mlxq:<alias>@high, mlxq@high, mlxq:<alias>, mlxq, ...)"))
    p.add_argument("--max-num-seqs", type=int, help="most sequences decoding at once (default 32)")
    p.add_argument("--default-max-tokens", type=int, help="max_tokens for requests that leave it unset (256)")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask for (4096)")
    p.add_argument("--max-prompt-tokens", type=int, help="longest prompt in tokens (32768)")
    p.add_argument("--max-result-entries", type=int,
                   help="most n x max_tokens x (1 + top_logprobs) of one request: what its result may hold (131072)")
    p.add_argument("--prefix-cache-mb", type=int,
                   help="memory for KV caches of prompts reused across jobs; 0 turns it off (default 1024)")
    p.add_argument("--adapter-dir", help="folder whose subdirectories are LoRA adapters by name (MLXQ_ADAPTER_DIR)")
    p.add_argument("--adapter-memory-mb", type=int,
                   help="memory for resident LoRA adapters, least recently used out first (default 1024)")
    p.add_argument("--decode", choices=("auto", "compiled", "batch-generator"),
                   help="decode path (MLXQ_DECODE; default auto: mlxq's compiled engine where it is exact)")
    p.add_argument("--decode-warmup", choices=("background", "blocking", "off"), help=(
        "the compiled decode step's shapes (MLXQ_DECODE_WARMUP; default background: serve at once while a "
        "low-priority process builds their kernels; blocking: compile them before taking jobs; off: each at first use)"))
    p.add_argument("--decode-warmup-tokens", type=int, help=(
        "the warm-up covers sequences up to this many tokens (MLXQ_DECODE_WARMUP_TOKENS; default 512; 0: none)"))
    p.add_argument("--speculative", choices=("off", "ngram", "draft"), help=(
        "speculative decoding (MLXQ_SPECULATIVE; default off): ngram (prompt lookup) or draft (--draft-model "
        "proposes); exact, on the compiled decode path (docs/speculative.md)"))
    p.add_argument("--draft-model", help="the draft model for --speculative draft: directory, .gguf file or hub id, "
                   "with the served model's tokenizer (MLXQ_DRAFT_MODEL)")
    p.add_argument("--speculative-k", type=int, help="most tokens a row proposes per step (MLXQ_SPECULATIVE_K; 4)")
    p.add_argument("--speculative-max-positions", type=int, help=(
        "most slots x (1 + k) positions one verification pass runs (MLXQ_SPECULATIVE_MAX_POSITIONS; 64)"))
    p.add_argument("--speculative-pass-cost", type=float, help=(
        "a verification pass's time over a decode step's, fixed, for deciding whether one pays "
        "(MLXQ_SPECULATIVE_PASS_COST; default: measured while serving, per width, from 2 on a CPU, "
        "1.75 on CUDA, 1.25 on Metal)"))
    p.add_argument("--upcast", action=argparse.BooleanOptionalAction, default=None, help=(
        "CPU: half-precision (bfloat16/float16) tensors become float32 at load (MLXQ_UPCAST; default on)"))
    p.add_argument("--keep-quantized", action=argparse.BooleanOptionalAction, default=None, help=(
        "keep quantized layers quantized (MLXQ_KEEP_QUANTIZED; default off: dequantized at load on CPU and CUDA "
        "when memory allows; Metal always keeps them)"))
    p.add_argument("--metrics-port", type=int, help=(
        "serve Prometheus metrics on this port (MLXQ_METRICS_PORT); with --processes N, process i on port + i"))
    p.add_argument("--blas", help="Linux CPU: auto | off | path to a BLAS library (default auto: OpenBLAS)")
    p.add_argument("--blas-threads", type=int,
                   help="Linux CPU: that BLAS's threads (default one per core; several workers a host: a share each)")
    p.add_argument("--metal-wired-limit-mb", type=int, help="macOS: Metal wired memory limit")
    p.add_argument("--metal-cache-limit-mb", type=int, help="macOS: Metal buffer cache limit")
    _add_more_worker_flags(p)
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
    p.add_argument("--shape", default="tiny", help="tiny | smollm-135m | qwen2.5-0.5b | qwen2.5-7b (with --vision: tiny | small)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="llama", help="llama | mistral | qwen2 | qwen3 | gemma | gemma2 | gemma3_text")
    p.add_argument("--vision", action="store_true", help="a qwen2_vl vision-language model (images and text)")
    p.add_argument("--tokenizer-from", help=(
        "a model directory or .gguf file whose tokenizer (and vocabulary size) the model takes: a random draft "
        "model for --speculative draft (docs/speculative.md)"))
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="the whole pipeline on this machine, with embedded defaults")
    p.add_argument("--url", help=f"use this Redis instead of starting a private one ({URL_PASSWORD_NOTE})")
    p.add_argument("--model", help="use this model instead of the packaged real one (mlxq real-model)")
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight model (gibberish, starts in a second)")
    p.add_argument("--jobs", type=int, default=48)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--max-tokens", type=int, help="new tokens per job (48 on the real model, else 32)")
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
    stats_command.register(sub)
    real_model.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
