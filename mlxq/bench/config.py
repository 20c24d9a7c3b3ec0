"""BenchConfig: every knob of one `mlxq bench` run, filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ARMS = ("A", "B", "C", "D", "E", "S", "K")
SCENARIOS = ("throughput", "overhead", "late-joiner", "rl", "prefix-cache", "soak", "structured", "gateway-stream",
             "gateway-blocking", "images", "weights", "startup", "speculative")
# --weights: the in-process arms' model as a worker serves it on this device, or as mlx-lm loads it
WEIGHTS = ("worker", "as-loaded")

# --scenario rl: n samples vs independent requests, the cost of a weight swap, mixed adapters
RL_PARTS = ("samples", "swap", "adapters")

ARM_LABELS = {
    "A": "A: one job at a time (mlx-lm generate_step, model loaded once)",
    "B": "B: engine bound (mlx-lm BatchGenerator, requests known up front, no queue)",
    "C": "C: mlxq end to end (producer -> Redis -> BatchWorker -> result keys)",
    "D": "D: mlx_lm.server (HTTP, continuous batching), concurrent streaming clients",
    "E": "E: vllm-mlx BatchedEngine, driven in process by concurrent asyncio clients",
    "S": "S: mlxq's BatchScheduler and the engine a worker picks, in process (no Redis, RQ or worker loop)",
    "K": "K: mlxq's compiled decode engine alone, in process (as B: no scheduler, queue or worker loop)",
}


@dataclass
class BenchConfig:
    out: Path
    model: Optional[str] = None  # a model path (or hub id); else `shape` is built
    shape: str = "smollm-135m"
    dtype: str = "float32"  # of a built --shape model
    model_cache: Optional[Path] = None
    arms: tuple[str, ...] = ("A", "B", "C", "D")
    scenarios: tuple[str, ...] = ("throughput",)
    concurrency: tuple[int, ...] = (1, 8, 32, 128)
    rounds: int = 1  # closed loop: requests each client sends, one after the other
    repeats: int = 1  # the arms run this many times, interleaved (A B C, A B C, ...)
    rates: tuple[float, ...] = ()  # open loop: Poisson arrival rates (requests/s)
    open_requests: int = 32
    prompt_tokens: int = 64
    new_tokens: int = 64
    new_tokens_spread: int = 0  # each request asks new_tokens +- up to this many
    max_num_seqs: int = 32
    prefill_batch_size: int = 8
    workers: tuple[int, ...] = (1, 2)
    a_max_concurrency: int = 32  # A is sequential: larger N only lengthens its queue
    warmup_tokens: int = 8
    headline_concurrency: int = 32
    url: Optional[str] = None  # an existing Redis; default: a private redis-server
    vllm_mlx_venv: Optional[Path] = None
    create_venv: bool = False
    seed: int = 0
    request_timeout_s: float = 1800.0
    # scenario knobs
    overhead_jobs: int = 2000
    overhead_tokens: int = 1
    overhead_offered_per_s: float = 3000.0  # jobs/s offered in the sustained run: does one worker keep up?
    overhead_publish: int = 256
    overhead_step_ms: float = 10.0
    metrics_port: Optional[int] = None  # overhead: the fake worker serves metrics here, scraped every second
    late_long: int = 31
    late_long_tokens: int = 2048
    late_short_tokens: int = 8
    late_delay_s: float = 2.0
    late_joins: int = 8  # short jobs joining the long ones, one after another
    rl_prompts: int = 64
    rl_n: int = 8
    rl_prompt_tokens: int = 256
    rl_new_tokens: int = 64
    rl_parts: tuple[str, ...] = RL_PARTS  # what --scenario rl runs (mlxq/bench/scenario_rl_swap.py)
    rl_swap_sequences: int = 64  # the decoding load a weight swap lands on, over the fleet
    rl_swap_new_tokens: int = 128  # each of its requests: this +- half of it
    rl_swap_steady_s: float = 3.0  # steady load before and after each swap
    rl_swap_rounds: int = 2  # each policy this many times per fleet size
    prefix_requests: int = 64
    prefix_shared_tokens: int = 512  # the system prompt every request starts with
    prefix_suffix_tokens: int = 32  # then each request's own tokens
    prefix_new_tokens: int = 32
    prefix_cache_mb: int = 1024  # the worker's MLXQ_PREFIX_CACHE_MB in the cache-on run
    soak_jobs: int = 2000
    soak_rate: float = 10.0
    soak_max_tokens: int = 16
    soak_invalid: float = 0.1
    soak_engine: str = "model"  # "model" | "fake"
    soak_sample_s: float = 1.0
    gateway_clients: int = 256  # gateway scenarios: concurrent clients (mlxq/bench/scenario_gateway.py)
    gateway_requests: int = 3000  # gateway-blocking: requests per arm
    image_model: Optional[str] = None  # a vision-language model; default: build the `image_shape` one
    image_shape: str = "small"
    image_requests: int = 32
    image_new_tokens: int = 32
    weights: str = "worker"  # the in-process arms' weight formats (WEIGHTS); C's workers follow it
    weights_variants: tuple[str, ...] = ("as-loaded", "upcast", "worker")  # scenario weights
    weights_rows: tuple[int, ...] = (1, 8)
    weights_steps: int = 8
    weights_prefill: int = 128
    startup_cold: bool = True  # scenario startup: each worker starts with an empty kernel cache
    startup_wave: int = 8
    startup_paths: tuple[str, ...] = ("batch-generator", "auto")  # scenario_startup.PATHS
    # scenario speculative (mlxq/bench/scenario_speculative.py)
    spec_drafters: tuple[str, ...] = ("ngram", "draft-self", "draft-random")
    spec_workloads: tuple[str, ...] = ("grounded", "chat")
    spec_sampling: tuple[str, ...] = ("greedy",)
    spec_rows: tuple[int, ...] = (1, 8, 32)
    spec_new_tokens: int = 64
    spec_k: Optional[int] = None  # the workers' --speculative-k; None: theirs
    spec_temperature: float = 0.7
    spec_ignore_eos: bool = False
    spec_draft_model: Optional[str] = None  # the `draft` drafter's model
    spec_in_process: bool = False  # each arm an engine in the bench's process instead of a worker
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ValueError(f"--arms: unknown arm(s) {bad}; choose from {','.join(ARMS)}")
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad:
            raise ValueError(f"--scenario: unknown scenario(s) {bad}; choose from {','.join(SCENARIOS)} or all")
        for name in ("rounds", "repeats", "open_requests", "prompt_tokens", "new_tokens", "max_num_seqs",
                     "prefill_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("prefix_requests", "prefix_shared_tokens", "prefix_suffix_tokens", "prefix_new_tokens",
                     "prefix_cache_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.new_tokens_spread < self.new_tokens:
            raise ValueError("--new-tokens-spread must be >= 0 and below --new-tokens")
        if any(n < 1 for n in self.concurrency) or any(w < 1 for w in self.workers):
            raise ValueError("--concurrency and --workers take positive integers")
        if any(r <= 0 for r in self.rates):
            raise ValueError("--rates take positive numbers (requests per second)")
        if not self.rl_parts or any(part not in RL_PARTS for part in self.rl_parts):
            raise ValueError(f"--rl-parts: choose from {','.join(RL_PARTS)}")
        if self.rl_swap_sequences < 1 or self.rl_swap_new_tokens < 2 or self.rl_swap_rounds < 1:
            raise ValueError("--rl-swap-sequences and --rl-swap-rounds must be >= 1, --rl-swap-new-tokens >= 2")
        if self.image_requests < 1 or self.image_new_tokens < 1:
            raise ValueError("--image-requests and --image-new-tokens must be >= 1")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights: {' or '.join(WEIGHTS)}")
        from mlxq.bench.scenario_weights import WEIGHT_VARIANTS

        if not self.weights_variants or any(v not in WEIGHT_VARIANTS for v in self.weights_variants):
            raise ValueError(f"--weights-variants: choose from {','.join(WEIGHT_VARIANTS)}")
        if any(n < 1 for n in self.weights_rows) or self.weights_steps < 1 or self.weights_prefill < 8:
            raise ValueError("--weights-rows and --weights-steps must be >= 1, --weights-prefill >= 8")
        if self.startup_wave < 1:
            raise ValueError("--startup-wave must be >= 1")
        from mlxq.bench.scenario_startup import PATHS

        if not self.startup_paths or any(p not in PATHS for p in self.startup_paths):
            raise ValueError(f"--startup-paths: choose from {','.join(PATHS)}")
        self._validate_speculative()
        if self.soak_engine not in ("model", "fake"):
            raise ValueError("--soak-engine is model or fake")

    def _validate_speculative(self) -> None:
        from mlxq.bench.scenario_speculative import SAMPLINGS, SPEC_DRAFTERS
        from mlxq.bench.spec_workloads import SPEC_WORKLOADS

        for name, given, allowed in (("--spec-drafters", self.spec_drafters, SPEC_DRAFTERS),
                                     ("--spec-workloads", self.spec_workloads, SPEC_WORKLOADS),
                                     ("--spec-sampling", self.spec_sampling, SAMPLINGS)):
            if not given or any(v not in allowed for v in given) or len(set(given)) != len(given):
                raise ValueError(f"{name}: one or more of {','.join(allowed)}, each once")
        if "draft" in self.spec_drafters and not self.spec_draft_model:
            raise ValueError("--spec-drafters draft needs --spec-draft-model")
        if not self.spec_rows or any(n < 1 for n in self.spec_rows) or self.spec_new_tokens < 1:
            raise ValueError("--spec-rows and --spec-new-tokens take positive integers")
        if self.spec_k is not None and self.spec_k < 1:
            raise ValueError("--spec-k must be >= 1")
        if not self.spec_temperature > 0:
            raise ValueError("--spec-temperature must be > 0")

    @property
    def logs(self) -> Path:
        return self.out / "logs"
