"""GatewaySettings: every knob of `mlxq api`, from `MLXQ_API_*` variables (and `MLXQ_REDIS_URL`,
`MLXQ_PRIORITIES`), a `.env` file, or the command's flags. Errors name the variable.

API keys are never stored in the clear: `MLXQ_API_KEYS` lists `tenant:sha256hex` entries, the SHA-256
of each key (`printf %s "$KEY" | sha256sum`), comma-separated; several keys may share a tenant.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from schemas import RequestLimits, keys
from schemas.durability import Durability

__all__ = ["ApiKey", "GatewaySettings"]

_KEY_ENTRY = re.compile(r"^(?P<tenant>[A-Za-z0-9_.-]{1,64}):(?:sha256:)?(?P<digest>[0-9a-fA-F]{64})$")


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    sha256: str  # hex digest of the key


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MLXQ_API_", env_file=".env", extra="ignore",
                                      populate_by_name=True)

    redis_url: Optional[str] = Field(None, validation_alias=AliasChoices("MLXQ_REDIS_URL", "redis_url"))
    api_keys: Annotated[tuple[ApiKey, ...], NoDecode] = Field(
        (), validation_alias=AliasChoices("MLXQ_API_KEYS", "api_keys"))
    # Serve without keys on a non-loopback address (everyone is tenant "default").
    insecure: bool = False
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)  # JSON request bodies
    # A request's line and headers must arrive within this (from the connection's opening or the
    # request's first byte), then its body within body_timeout_s; else the connection is closed.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(300.0, gt=0)
    # On SIGTERM, requests in flight (streams too) get this long to end before they are cut; their jobs
    # run on, their results at /v1/jobs/{id}.
    shutdown_grace_s: float = Field(25.0, gt=0)
    max_queue_depth: int = Field(10_000, ge=0)  # 429 when the target queue is this deep; 0: no limit
    # A job is answered only once this many replicas have it (Redis's WAIT; 0: at once), else 503
    # `not_durable` naming it: what a failover of the primary can lose (docs/operations.md).
    durable_replicas: int = Field(0, ge=0)
    durable_timeout_ms: int = Field(2000, ge=1)
    tenant_max_in_flight: int = Field(1024, ge=1)  # a tenant's jobs submitted and not ended, at most
    # Tenants that may drive the control plane (/v1/control: weights, pause, abort; docs/rl.md), comma-separated.
    admin_tenants: Annotated[tuple[str, ...], NoDecode] = ()
    # /metrics and /dashboard (fleet numbers, no job's content) ask for an API key too (docs/operations.md).
    ops_require_key: bool = False
    history_interval_s: float = Field(5.0, gt=0)  # /dashboard: a fleet sample this often (one per fleet)
    history_window_s: float = Field(900.0, ge=60)  # ... kept this long, in Redis
    result_ttl: int = Field(3600, ge=1)  # seconds a gateway job's result is kept
    request_timeout_s: float = Field(3600.0, gt=0)  # a blocking request waits this long at most; a job runs as long
    models: Annotated[tuple[str, ...], NoDecode] = ()  # served names known even while no worker is live (503, not 404)
    presence_cache_s: float = Field(1.0, ge=0)  # live workers are re-read at most this often
    files_dir: Optional[Path] = None  # file contents on disk (shared by every replica) instead of in Redis
    file_max_bytes: int = Field(200 * 1024 * 1024, ge=1)
    file_max_lines: int = Field(50_000, ge=1)
    file_ttl_s: int = Field(30 * 24 * 3600, ge=60)  # uploads and batch outputs expire after this, by default
    # A tenant's files (uploads and batch outputs) that have not expired take at most this many bytes: an upload
    # past it is refused (413). Batch outputs are never refused, but count. 0: no quota.
    file_quota_bytes: int = Field(1024 * 1024 * 1024, ge=0)
    batch_max_in_flight: int = Field(64, ge=1)  # jobs of one batch submitted and not ended, at most
    batch_priority: Optional[str] = None  # the priority of batch jobs (e.g. low); None: the default queues
    # A batch job's result waits this long for a driver to copy it into the batch's output (then it expires).
    batch_result_ttl: int = Field(3600, ge=60)
    batch_drive_interval_s: float = Field(0.5, gt=0)
    priorities: Annotated[tuple[str, ...], NoDecode] = Field(
        keys.DEFAULT_PRIORITIES, validation_alias=AliasChoices("MLXQ_PRIORITIES", "priorities"))
    max_tokens: int = Field(RequestLimits.max_tokens, ge=1)
    max_prompt_chars: int = Field(RequestLimits.max_prompt_chars, ge=1)
    # n x max_tokens x (1 + top_logprobs) of one request at most (docs/requests.md); keep it at the workers'.
    max_result_entries: int = Field(RequestLimits.max_result_entries, ge=1)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_keys(cls, value: object) -> object:
        if isinstance(value, str):
            entries = [part.strip() for part in value.split(",") if part.strip()]
            parsed = []
            for entry in entries:
                match = _KEY_ENTRY.match(entry)
                if match is None:
                    shown = entry.split(":", 1)[0]
                    raise ValueError(f"MLXQ_API_KEYS: entry for {shown!r} is not tenant:sha256hex "
                                     "(the key's SHA-256 in hex, never the key itself)")
                parsed.append(ApiKey(match["tenant"], match["digest"].lower()))
            return tuple(parsed)
        return value

    @field_validator("models", "priorities", "admin_tenants", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("priorities")
    @classmethod
    def _check_priorities(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        keys.check_priorities(value, "MLXQ_PRIORITIES")
        return value

    @property
    def job_timeout_s(self) -> int:
        """The RQ timeout of the gateway's jobs: as long as a blocking request waits (RQ's own default,
        180 s, would end a long generation, or one of a large batch decoding together, mid-way)."""
        return math.ceil(self.request_timeout_s)

    @property
    def durability(self) -> Optional[Durability]:
        return Durability(self.durable_replicas, self.durable_timeout_ms) if self.durable_replicas else None

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_tokens=self.max_tokens, max_prompt_chars=self.max_prompt_chars,
                             max_result_entries=self.max_result_entries)

    def __repr__(self) -> str:  # the URL may hold a password; key digests are not for logs either
        return f"GatewaySettings(keys={len(self.api_keys)}, files_dir={self.files_dir})"
