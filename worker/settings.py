"""WorkerSettings: every knob of a worker, as a pydantic-settings model. `WorkerSettings.from_env()`
reads the `MLXQ_*` environment variables and a `.env` file in the working directory (the variables
win); the `mlxq worker` flags override both. Plain `WorkerSettings(...)` reads neither. Values are
validated at start: an error names the variable (docs/configuration.md). The Redis URL
is a secret: never shown by a repr, a log line or an error."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import Annotated, Any, Optional

from pydantic import SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from schemas import RequestLimits, keys
from schemas.durability import Durability
from worker.image_fetch import AddressPolicy
from worker.images import ImagePolicy

ENV_PREFIX = "MLXQ_"
ENV_FILE = ".env"
# Set only while `from_env` builds settings: plain construction reads no environment or .env file.
_READ_ENVIRONMENT: contextvars.ContextVar[bool] = contextvars.ContextVar("mlxq_read_environment", default=False)


class SettingsError(ValueError):
    """A setting that does not validate; the message names the variable, never a secret's value."""


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=ENV_FILE, env_ignore_empty=True, extra="ignore")

    # Redis, when not given by `--url` (MLXQ_REDIS_URL; a .env file may hold it): a secret.
    redis_url: Optional[SecretStr] = None
    # `mlxq worker --processes N`: worker processes on this host.
    processes: int = 1
    model: Optional[str] = None  # directory, .gguf file or hub id; MLXQ_MODEL
    alias: Optional[str] = None  # name requests use in `model`; default: model's last path component (a .gguf's stem)
    max_num_seqs: int = 32  # most sequences decoding at once
    default_max_tokens: int = 256  # for requests that leave max_tokens unset
    max_tokens_limit: int = 4096
    max_prompt_tokens: int = 32768
    # n x max_tokens x (1 + top_logprobs) of one request at most: what its result can hold (docs/requests.md).
    max_result_entries: int = RequestLimits.max_result_entries
    # A job hash bigger than this (its request, images inline) fails unread: decoding it would stall decoding.
    max_job_bytes: int = 16 * 1024 * 1024
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    heartbeat_interval_s: float = 5.0  # job heartbeat TTL is 3x this (+5 s): a dead worker's jobs free up fast
    step_timeout_s: float = 300.0  # watchdog: a single engine step longer than this exits the process
    sweep_interval_s: float = 15.0  # how often a busy worker re-queues / fails jobs of dead workers
    stop_grace_s: float = 30.0  # a stopping worker waits this long for an unreachable Redis to take its results
    kv_budget_mb: Optional[int] = None  # KV-cache memory for admission; default: half the machine's RAM
    # Prompt (prefix) cache across jobs, on top of the KV budget; 0 turns it off. 1 GiB holds ~85k
    # tokens of a 0.5B model or ~8k of an 8B one: a few long system prompts and recent conversations,
    # small next to the weights and the KV budget on the machines we target (16 GB and up).
    prefix_cache_mb: int = 1024
    # LoRA adapters (docs/rl.md, "Adapters"): the folder whose subdirectories are adapters by name,
    # and the memory resident adapters may take (least recently used out first).
    adapter_dir: Optional[str] = None
    adapter_memory_mb: int = 1024
    # Set by `mlxq worker --processes N` for its processes: they share waiting jobs out fairly.
    group: Optional[str] = None
    engine: str = "mlx"  # "mlx"; "fake" is a model-free deterministic engine for tests and queue benchmarks
    fake_step_delay_s: float = 0.0
    # How the mlx engine decodes: "auto" (mlxq's compiled engine where it is exact, else mlx-lm's
    # BatchGenerator; the worker logs which and why), "compiled" (refuse to start where it is not
    # exact), "batch-generator" (always mlx-lm's). See docs/engine.md.
    decode: str = "auto"
    # The compiled engine's decode step shapes (every batch bucket, sequences up to
    # decode_warmup_tokens): "background" (the worker serves at once; a low-priority process
    # builds their kernels, and each shape compiles at its first step after that, running
    # uncompiled until then), "blocking" (compiled before the first job is taken), "off" (each
    # compiles at its first step). Longer sequences' shapes compile when first needed.
    decode_warmup: str = "background"
    decode_warmup_tokens: int = 512
    # Speculative decoding (docs/speculative.md): "off", "ngram" (prompt lookup) or "draft" (the model at
    # draft_model, same tokenizer, proposes). Exact: the same tokens, distribution and logprobs as without.
    # Needs the compiled decode path; on mlx-lm's the worker logs why and runs without.
    speculative: str = "off"
    draft_model: Optional[str] = None  # directory, .gguf file or hub id of the draft model
    speculative_k: int = 4  # most tokens a row proposes per step
    # Most positions (slots x (1 + k)) one verification pass runs: larger batches propose fewer tokens or none.
    speculative_max_positions: int = 64
    # A verification pass's time over a decode step's, fixed, for deciding whether a pass pays (default:
    # measured while serving, from a prior per platform: worker/engines/speculation/pass_cost.py).
    speculative_pass_cost: Optional[float] = None
    # Agents (docs/tools.md): the tool-call format replies are parsed and forced in ("auto": picked from
    # the model's chat template and config; or hermes, llama3_json, mistral, one of mlx-lm's parsers),
    # and whether a thinking model's reasoning is split from its answer ("auto" | "none").
    tool_call_format: str = "auto"
    reasoning: str = "auto"
    # Weight formats at load (worker/weight_prep.py): on a CPU, half-precision tensors become float32
    # (MLX's CPU half-precision arithmetic is slow); off Metal, quantized layers are dequantized when
    # memory allows. Each can be turned off.
    upcast: bool = True
    keep_quantized: bool = False
    blas: str = "auto"  # Linux CPU only: "auto" | "off" | path to a BLAS shared library
    # Linux CPU only: threads of that BLAS; default one per core. Several workers on one host: a share each.
    blas_threads: Optional[int] = None
    metal_wired_limit_mb: Optional[int] = None  # macOS Metal only
    metal_cache_limit_mb: Optional[int] = None  # macOS Metal only
    trust_remote_code: bool = False
    # Images (vision-language models; see docs/images.md).
    image_dir: Optional[str] = None  # the one folder local image paths may name; unset: no local files
    max_images: int = RequestLimits.max_images  # image parts per request
    max_image_bytes: int = RequestLimits.max_image_bytes  # an image's encoded size, from any source
    max_image_pixels: int = ImagePolicy.max_pixels  # width x height, read from the header before decoding
    image_fetch: bool = False  # fetch http(s) image URLs (off: such a request fails)
    image_fetch_timeout_s: float = ImagePolicy.fetch_timeout_s
    image_fetch_max_redirects: int = ImagePolicy.fetch_max_redirects
    # Networks a fetch may reach beside public addresses (CIDRs: an internal image store; the tests' loopback servers).
    image_fetch_allow_nets: Annotated[tuple[str, ...], NoDecode] = ()
    image_io_threads: int = 16  # image inputs read from files or fetched at once (each job's own within its deadline)
    callback_allowlist: Annotated[tuple[str, ...], NoDecode] = ()  # RQ callback name prefixes allowed to run
    # Serve Prometheus metrics on this port (docs/operations.md); with --processes N, process i gets port + i.
    metrics_port: Optional[int] = None
    # A failed job runs again at most this many times, whatever its Retry asks (never after a refusal).
    max_retries: int = 5
    retry_backoff_s: float = 1.0  # pause before the first retry, doubled for each next one (at most 60 s)
    # Priorities, highest first (e.g. high,default,low): without explicit queues, the worker listens on each
    # priority's queues in turn (docs/producer.md). Empty: the contract's queues only.
    priorities: Annotated[tuple[str, ...], NoDecode] = ()
    # Replicas that must have a job's result (Redis WAIT) before it is announced; 0: none. Without it a
    # failover of the primary can lose results it had acknowledged (docs/operations.md, "Durability").
    durable_results: int = 0
    durable_timeout_ms: int = 2000  # how long each WAIT waits; fewer replicas by then: written again, later

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        if _READ_ENVIRONMENT.get():
            return init_settings, env_settings, dotenv_settings
        return (init_settings,)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "WorkerSettings":
        """Settings from the environment and `.env` (or from `environ` alone, when given), with
        `overrides` (the flags; None: not given) on top. SettingsError names what does not validate."""
        given = {name: value for name, value in overrides.items() if value is not None}
        token = None
        if environ is None:
            token = _READ_ENVIRONMENT.set(True)
        else:
            given = {**{name: environ[env_name(name)] for name in cls.model_fields
                        if environ.get(env_name(name)) not in (None, "")}, **given}
        try:
            return cls(**given)
        except ValidationError as exc:
            raise SettingsError(describe(exc)) from None
        finally:
            if token is not None:
                _READ_ENVIRONMENT.reset(token)

    def to_env(self) -> dict[str, str]:
        """These settings as the `MLXQ_*` variables `from_env` reads back (unset fields left out)."""
        env = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                text = value.get_secret_value()
            elif isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, tuple):
                text = ",".join(value)
            else:
                text = str(value)
            env[env_name(name)] = text
        return env

    def replace(self, **changes: Any) -> "WorkerSettings":
        """A copy with `changes`, validated (dataclasses.replace's twin)."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})

    @field_validator("callback_allowlist", "priorities", "image_fetch_allow_nets", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @model_validator(mode="after")
    def _checked(self) -> "WorkerSettings":
        self.validate()
        return self

    @property
    def redis_url_value(self) -> Optional[str]:
        return self.redis_url.get_secret_value() if self.redis_url is not None else None

    def validate(self) -> None:  # type: ignore[override]  # (pydantic's deprecated classmethod of that name)
        if self.processes < 1:
            raise ValueError(f"MLXQ_PROCESSES must be >= 1, got {self.processes}")
        for name in ("max_num_seqs", "default_max_tokens", "max_tokens_limit", "max_prompt_tokens", "max_result_entries",
                     "prefill_batch_size", "prefill_step_size", "max_job_bytes", "max_images", "max_image_bytes",
                     "max_image_pixels", "image_io_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLXQ_{name.upper()} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0 or self.retry_backoff_s < 0:
            raise ValueError("MLXQ_MAX_RETRIES and MLXQ_RETRY_BACKOFF_S must be >= 0")
        if self.blas_threads is not None and self.blas_threads < 1:
            raise ValueError(f"MLXQ_BLAS_THREADS must be >= 1, got {self.blas_threads}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"MLXQ_PREFIX_CACHE_MB must be >= 0 (0 turns the cache off), got {self.prefix_cache_mb}")
        if self.adapter_memory_mb < 1:
            raise ValueError(f"MLXQ_ADAPTER_MEMORY_MB must be >= 1, got {self.adapter_memory_mb}")
        if self.decode not in ("auto", "compiled", "batch-generator"):
            raise ValueError(f"MLXQ_DECODE must be auto, compiled or batch-generator, got {self.decode!r}")
        if self.reasoning not in ("auto", "none"):
            raise ValueError(f"MLXQ_REASONING must be auto or none, got {self.reasoning!r}")
        if self.decode_warmup not in ("background", "blocking", "off"):
            raise ValueError(f"MLXQ_DECODE_WARMUP must be background, blocking or off, got {self.decode_warmup!r}")
        if self.speculative not in ("off", "ngram", "draft"):
            raise ValueError(f"MLXQ_SPECULATIVE must be off, ngram or draft, got {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("MLXQ_SPECULATIVE=draft needs MLXQ_DRAFT_MODEL (--draft-model): the draft model's path")
        if self.draft_model and self.speculative != "draft":
            raise ValueError("MLXQ_DRAFT_MODEL is set but MLXQ_SPECULATIVE is not draft: set --speculative draft")
        if not 1 <= self.speculative_k <= 16:
            raise ValueError(f"MLXQ_SPECULATIVE_K must be 1..16, got {self.speculative_k}")
        if self.speculative_pass_cost is not None and not 1.0 <= self.speculative_pass_cost <= 16.0:
            raise ValueError(f"MLXQ_SPECULATIVE_PASS_COST must be 1..16, got {self.speculative_pass_cost}")
        if self.speculative_max_positions < 2:
            raise ValueError(f"MLXQ_SPECULATIVE_MAX_POSITIONS must be >= 2, got {self.speculative_max_positions}")
        if self.decode_warmup_tokens < 0:
            raise ValueError(f"MLXQ_DECODE_WARMUP_TOKENS must be >= 0, got {self.decode_warmup_tokens}")
        if self.priorities:
            keys.check_priorities(self.priorities, "MLXQ_PRIORITIES")
        try:
            AddressPolicy.parse(self.image_fetch_allow_nets)
        except ValueError as exc:
            raise ValueError(f"MLXQ_IMAGE_FETCH_ALLOW_NETS: {exc} (expected CIDRs such as 10.1.2.0/24)") from None
        if self.durable_results < 0 or self.durable_timeout_ms < 1:
            raise ValueError("MLXQ_DURABLE_RESULTS must be >= 0 and MLXQ_DURABLE_TIMEOUT_MS >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("MLXQ_DEFAULT_MAX_TOKENS must not exceed MLXQ_MAX_TOKENS_LIMIT")

    @property
    def served_alias(self) -> Optional[str]:
        if self.alias:
            return self.alias
        return keys.model_alias(self.model) if self.model else None

    def served_names(self) -> set[str]:
        """Names a request's `model` field may use to address this worker."""
        names = {n for n in (self.model, self.served_alias) if n}
        if self.model:
            names.add(keys.model_alias(self.model))
        return names

    def default_queues(self) -> list[str]:
        alias = self.served_alias
        queues = [keys.queue_for_model(alias), keys.DEFAULT_QUEUE] if alias else [keys.DEFAULT_QUEUE]
        return keys.prioritized_queues(queues, self.priorities) if self.priorities else queues

    @property
    def result_durability(self) -> Optional[Durability]:
        return Durability(self.durable_results, self.durable_timeout_ms) if self.durable_results else None

    @property
    def heartbeat_ttl_s(self) -> int:
        return int(self.heartbeat_interval_s * 3 + 5)

    @property
    def kv_budget_bytes(self) -> int:
        if self.kv_budget_mb is not None:
            return self.kv_budget_mb * 1024 * 1024
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache_mb * 1024 * 1024

    @property
    def adapter_memory_bytes(self) -> int:
        return self.adapter_memory_mb * 1024 * 1024

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_tokens=self.max_tokens_limit, max_prompt_tokens=self.max_prompt_tokens,
                             max_images=self.max_images, max_image_bytes=self.max_image_bytes,
                             max_result_entries=self.max_result_entries)

    @property
    def image_policy(self) -> ImagePolicy:
        return ImagePolicy(max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels, image_dir=self.image_dir,
                           fetch=self.image_fetch, fetch_timeout_s=self.image_fetch_timeout_s,
                           fetch_max_redirects=self.image_fetch_max_redirects,
                           fetch_addresses=AddressPolicy.parse(self.image_fetch_allow_nets))



def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def describe(exc: ValidationError) -> str:
    """The errors of `exc`, each naming its variable and flag; a secret's value is never shown."""
    lines = []
    for error in exc.errors(include_url=False):
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        field = str(error["loc"][0]) if error.get("loc") else None
        if field is None:
            lines.append(message)  # a check across fields: its message names the variables
            continue
        secret = WorkerSettings.model_fields.get(field) is not None and \
            WorkerSettings.model_fields[field].annotation in (SecretStr, Optional[SecretStr])
        shown = "" if secret else f" (got {error.get('input')!r})"
        lines.append(f"{env_name(field)} (--{field.replace('_', '-')}): {message}{shown}")
    return "; ".join(lines)
