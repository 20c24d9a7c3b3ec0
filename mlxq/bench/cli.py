"""The `mlxq bench` verb: `register(subparsers)` adds it to the main CLI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, TypeVar

from mlxq.bench.config import ARMS, RL_PARTS, SCENARIOS, WEIGHTS, BenchConfig

__all__ = ["register", "config_from_args"]

T = TypeVar("T")

DESCRIPTION = """\
Benchmark mlxq against its alternatives on one machine, with the same model and the same requests:
  A  one job at a time (mlx-lm generate_step per request, model loaded once)
  B  the engine bound: mlx-lm BatchGenerator, every request known up front, no queue
  C  mlxq end to end: producer -> Redis -> BatchWorker process(es) -> result keys (--workers)
  D  mlx_lm.server driven by concurrent streaming HTTP clients
  E  vllm-mlx BatchedEngine from a separate venv (--vllm-mlx-venv DIR [--create-venv])
  S  mlxq's BatchScheduler + the engine a worker picks, in this process, no Redis or RQ: S/B prices
     mlxq's engine wrapper, C/S the queue around it
  K  mlxq's compiled decode engine alone in this process, fed as B is: K/B is the engine against mlx-lm's
Workloads: closed loop (--concurrency N clients) and open loop (Poisson --rates). Scenarios
(--scenario): throughput (the arms), overhead, late-joiner, rl, prefix-cache, soak, structured, images (image jobs
alone, through mlx-vlm's batched generation and through mlxq), weights (the model's weight formats on this
device: decode step and prefill), startup (a fresh worker's first answer and early throughput, per decode
path), speculative (tokens/s with and without speculative decoding, per drafter, on input-grounded
and open chat requests), or all. --model takes a model directory, a .gguf file or a hub id.
The throughput arms' greedy texts are checked: each workload's first request alone through mlx-lm is
the reference, and the table says per arm whether its text equals it, and how many requests equal B's.
Writes report.json, table.md, plot.png and records.jsonl to --out, and prints the table.
"""


def _list(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def _scenarios(text: str) -> tuple[str, ...]:
    return SCENARIOS if text.strip() == "all" else _list(str)(text)


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("bench", help="benchmark mlxq against one-at-a-time, the engine bound and peers",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", help="a model path (or hub id); default: build a random-weight --shape model")
    g.add_argument("--shape", default="smollm-135m", help="tiny | smollm-135m | qwen2.5-0.5b (default smollm-135m)")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16, for a built --shape model")
    g.add_argument("--model-cache", type=Path, help="where built models are kept (default ~/.cache/mlxq/bench-models)")
    g.add_argument("--weights", choices=WEIGHTS, default="worker",
                   help="A, B, S, K and C's workers run the model as a worker serves it on this device (worker: "
                        "half precision upcast on a CPU, quantized layers dequantized off Metal) or as mlx-lm loads "
                        "it (as-loaded); D and E always load it as it is")

    g = p.add_argument_group("what to run")
    g.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default ./bench-out)")
    g.add_argument("--arms", type=_list(str), default=ARMS, help="comma-separated subset of A,B,C,D,E,S,K (default all)")
    g.add_argument("--scenario", type=_scenarios, default=("throughput",),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}, or all (default throughput)")
    g.add_argument("--concurrency", type=_list(int), default=(1, 8, 32, 128), help="closed-loop clients (1,8,32,128)")
    g.add_argument("--rounds", type=int, default=1, help="requests per closed-loop client, sent in turn (default 1)")
    g.add_argument("--repeats", type=int, default=1,
                   help="run the arms this many times, interleaved (A B C, A B C, ...); ratios are then the median "
                        "of each repeat's own ratio, so drift on a noisy machine hits every arm alike (default 1)")
    g.add_argument("--rates", type=_list(float), default=(1.0, 2.0), help="open-loop Poisson rates, requests/s (1,2)")
    g.add_argument("--open-requests", type=int, default=32, help="requests per open-loop rate (default 32)")
    g.add_argument("--prompt-tokens", type=int, default=64)
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--new-tokens-spread", type=int, default=0,
                   help="each request asks --new-tokens +- up to this many (uniform, seeded; default 0)")
    g.add_argument("--max-num-seqs", type=int, default=32,
                   help="decode batch limit for B, C, D, E; C's workers share it (default 32)")
    g.add_argument("--prefill-batch-size", type=int, default=8, help="prompts prefilled together (default 8)")
    g.add_argument("--workers", type=_list(int), default=(1, 2),
                   help="mlxq worker processes for arm C (1,2); with a preloaded BLAS (Linux CPU) "
                        "each gets cores / workers BLAS threads")
    g.add_argument("--a-max-concurrency", type=int, default=32,
                   help="run arm A only up to this N: it is sequential (default 32)")
    g.add_argument("--warmup-tokens", type=int, default=8, help="new tokens per warm-up request (default 8)")
    g.add_argument("--headline-concurrency", type=int, default=32, help="N for the headline ratios (default 32)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds one workload may take per arm")

    g = p.add_argument_group("infrastructure")
    g.add_argument("--url", help="an existing Redis (default: start a private redis-server)")
    g.add_argument("--vllm-mlx-venv", type=Path, help="venv with vllm-mlx 0.6.0 for arm E")
    g.add_argument("--create-venv", action="store_true", help="build --vllm-mlx-venv if it does not exist")

    g = p.add_argument_group("scenarios")
    g.add_argument("--overhead-jobs", type=int, default=2000)
    g.add_argument("--overhead-tokens", type=int, default=1)
    g.add_argument("--overhead-offered", type=float, default=3000.0,
                   help="jobs/s offered in the sustained run (default 3000)")
    g.add_argument("--overhead-publish", type=int, default=256, help="results finishing in one step")
    g.add_argument("--overhead-step-ms", type=float, default=10.0, help="fake step cost for the publish test")
    g.add_argument("--metrics-port", type=int, help="overhead: the worker serves Prometheus metrics on this port "
                                                     "(mlxq worker --metrics-port), scraped every second")
    g.add_argument("--late-long", type=int, default=31)
    g.add_argument("--late-long-tokens", type=int, default=2048, help="long jobs' max tokens (cancelled once the joins are done)")
    g.add_argument("--late-joins", type=int, default=8, help="short jobs joining the long ones, one after another")
    g.add_argument("--late-short-tokens", type=int, default=8)
    g.add_argument("--late-delay", type=float, default=2.0, help="seconds between the long jobs starting and the short")
    g.add_argument("--rl-prompts", type=int, default=64)
    g.add_argument("--rl-n", type=int, default=8)
    g.add_argument("--rl-prompt-tokens", type=int, default=256)
    g.add_argument("--rl-new-tokens", type=int, default=64)
    g.add_argument("--rl-parts", type=_list(str), default=RL_PARTS,
                   help="rl: samples (n=8 vs independent), swap (a weight swap's cost per policy, on 1 and 2 "
                        "workers: --workers), adapters (mixed LoRA adapters against none, one worker: "
                        "--rl-swap-sequences requests of --rl-swap-new-tokens); default all")
    g.add_argument("--rl-swap-sequences", type=int, default=64, help="rl swap: sequences decoding over the fleet (64)")
    g.add_argument("--rl-swap-new-tokens", type=int, default=128, help="rl swap: new tokens per request, +- half (128)")
    g.add_argument("--rl-swap-steady", type=float, default=3.0, help="rl swap: seconds of steady load around a swap (3)")
    g.add_argument("--rl-swap-rounds", type=int, default=2, help="rl swap: swaps per policy and fleet size (2)")
    g.add_argument("--prefix-requests", type=int, default=64, help="prefix-cache: requests sent at once (64)")
    g.add_argument("--prefix-shared-tokens", type=int, default=512, help="prefix-cache: shared prefix length (512)")
    g.add_argument("--prefix-suffix-tokens", type=int, default=32, help="prefix-cache: each request's own tokens (32)")
    g.add_argument("--prefix-new-tokens", type=int, default=32, help="prefix-cache: new tokens per request (32)")
    g.add_argument("--prefix-cache-mb", type=int, default=1024, help="prefix-cache: the worker's cache size when on")
    g.add_argument("--soak-jobs", type=int, default=2000)
    g.add_argument("--soak-rate", type=float, default=10.0, help="jobs/s (Poisson)")
    g.add_argument("--soak-max-tokens", type=int, default=16)
    g.add_argument("--soak-invalid", type=float, default=0.1, help="fraction of invalid jobs")
    g.add_argument("--soak-engine", choices=("model", "fake"), default="model")
    g.add_argument("--soak-sample", type=float, default=1.0, help="seconds between RSS samples")
    g.add_argument("--gateway-clients", type=int, default=256, help="gateway scenarios: concurrent clients (256)")
    g.add_argument("--gateway-requests", type=int, default=3000, help="gateway-blocking: requests per arm (3000)")
    g.add_argument("--image-model", help="images: a vision-language model (default: build --image-shape)")
    g.add_argument("--image-shape", default="small", help="images: tiny | small random qwen2_vl (default small)")
    g.add_argument("--image-requests", type=int, default=32, help="images: image jobs sent at once (32)")
    g.add_argument("--image-new-tokens", type=int, default=32, help="images: new tokens per job (32)")
    g.add_argument("--weights-variants", type=_list(str), default=("as-loaded", "upcast", "worker"),
                   help="weights: formats to time, the first is the baseline: as-loaded, upcast, dequantized, "
                        "upcast-dequantized, worker (default as-loaded,upcast,worker)")
    g.add_argument("--weights-rows", type=_list(int), default=(1, 8), help="weights: decode step rows (1,8)")
    g.add_argument("--weights-steps", type=int, default=8, help="weights: timed decode steps per row count (8)")
    g.add_argument("--weights-prefill", type=int, default=128, help="weights: prompt tokens of the timed prefill (128)")
    g.add_argument("--startup-cold", action=argparse.BooleanOptionalAction, default=True,
                   help="startup: each worker starts with an empty kernel cache, as on a new machine (default on)")
    g.add_argument("--startup-wave", type=int, default=8, help="startup: requests at once after the first (8)")
    g.add_argument("--startup-paths", type=_list(str), default=("batch-generator", "auto"),
                   help="startup: the workers compared: batch-generator, auto (the default worker), blocking (auto "
                        "with every shape compiled before the first job) (default batch-generator,auto)")
    g.add_argument("--spec-drafters", type=_list(str), default=("ngram", "draft-self", "draft-random"),
                   help="speculative: the arms compared with a worker without speculation: ngram (prompt lookup), "
                        "draft-self (the model as its own draft), draft-random (a tiny random draft with the "
                        "model's vocabulary), draft (--spec-draft-model), control (a second worker "
                        "without speculation: the noise of the machine) (default ngram,draft-self,draft-random)")
    g.add_argument("--spec-workloads", type=_list(str), default=("grounded", "chat"),
                   help="speculative: grounded (copy, correct, list, summarize a passage in the prompt), chat "
                        "(open questions) (default both)")
    g.add_argument("--spec-sampling", type=_list(str), default=("greedy",),
                   help="speculative: greedy and/or sampled (--spec-temperature, seeded) (default greedy)")
    g.add_argument("--spec-rows", type=_list(int), default=(1, 8, 32), help="speculative: requests at once (1,8,32)")
    g.add_argument("--spec-new-tokens", type=int, default=64, help="speculative: max new tokens a request (64)")
    g.add_argument("--spec-k", type=int, help="speculative: the workers' --speculative-k (default: theirs)")
    g.add_argument("--spec-temperature", type=float, default=0.7, help="speculative: sampled requests' (0.7)")
    g.add_argument("--spec-ignore-eos", action="store_true",
                   help="speculative: every request makes --spec-new-tokens tokens (default: it ends at EOS)")
    g.add_argument("--spec-draft-model", help="speculative: the draft model of the `draft` drafter")
    g.add_argument("--spec-in-process", action="store_true",
                   help="speculative: each arm is its worker's scheduler and engine in this process, not a worker "
                        "process: no spread between processes, no queue (default: workers)")
    p.set_defaults(func=_run)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        out=args.out, model=args.model, shape=args.shape, dtype=args.dtype, model_cache=args.model_cache,
        arms=tuple(a.upper() for a in args.arms), scenarios=args.scenario, concurrency=args.concurrency,
        rounds=args.rounds, repeats=args.repeats, rates=args.rates, open_requests=args.open_requests,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens, new_tokens_spread=args.new_tokens_spread, max_num_seqs=args.max_num_seqs,
        prefill_batch_size=args.prefill_batch_size,
        workers=args.workers, a_max_concurrency=args.a_max_concurrency, warmup_tokens=args.warmup_tokens,
        headline_concurrency=args.headline_concurrency, url=args.url, vllm_mlx_venv=args.vllm_mlx_venv,
        create_venv=args.create_venv, seed=args.seed, request_timeout_s=args.timeout,
        overhead_jobs=args.overhead_jobs, overhead_tokens=args.overhead_tokens,
        overhead_offered_per_s=args.overhead_offered,
        overhead_publish=args.overhead_publish, overhead_step_ms=args.overhead_step_ms,
        metrics_port=args.metrics_port,
        late_long=args.late_long, late_long_tokens=args.late_long_tokens, late_short_tokens=args.late_short_tokens,
        late_delay_s=args.late_delay, late_joins=args.late_joins, rl_prompts=args.rl_prompts, rl_n=args.rl_n,
        rl_prompt_tokens=args.rl_prompt_tokens, rl_new_tokens=args.rl_new_tokens, rl_parts=args.rl_parts,
        rl_swap_sequences=args.rl_swap_sequences, rl_swap_new_tokens=args.rl_swap_new_tokens,
        rl_swap_steady_s=args.rl_swap_steady, rl_swap_rounds=args.rl_swap_rounds,
        prefix_requests=args.prefix_requests, prefix_shared_tokens=args.prefix_shared_tokens,
        prefix_suffix_tokens=args.prefix_suffix_tokens, prefix_new_tokens=args.prefix_new_tokens,
        prefix_cache_mb=args.prefix_cache_mb, soak_jobs=args.soak_jobs,
        soak_rate=args.soak_rate, soak_max_tokens=args.soak_max_tokens, soak_invalid=args.soak_invalid,
        soak_engine=args.soak_engine, soak_sample_s=args.soak_sample,
        gateway_clients=args.gateway_clients, gateway_requests=args.gateway_requests,
        image_model=args.image_model, image_shape=args.image_shape, image_requests=args.image_requests,
        image_new_tokens=args.image_new_tokens, weights=args.weights, weights_variants=args.weights_variants,
        weights_rows=args.weights_rows, weights_steps=args.weights_steps, weights_prefill=args.weights_prefill,
        startup_cold=args.startup_cold, startup_wave=args.startup_wave, startup_paths=args.startup_paths,
        spec_drafters=args.spec_drafters, spec_workloads=args.spec_workloads, spec_sampling=args.spec_sampling,
        spec_rows=args.spec_rows, spec_new_tokens=args.spec_new_tokens, spec_k=args.spec_k,
        spec_temperature=args.spec_temperature, spec_ignore_eos=args.spec_ignore_eos,
        spec_draft_model=args.spec_draft_model, spec_in_process=args.spec_in_process,
    )


def _run(args: argparse.Namespace) -> int:
    from mlxq.bench.runner import run_bench

    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        print(f"mlxq bench: {exc}", file=sys.stderr)
        return 2
    return run_bench(config, sys.argv)
