"""The control plane a trainer drives a fleet through: commands to the workers of one model, and
each worker's acknowledgement (docs/rl.md).

A command goes on the model's control stream (`mlxq:control:<model>`); every live worker serving
that model applies it between two engine steps and acknowledges it in `mlxq:ack:<command id>`
(worker name -> ControlAck JSON). The publisher waits until every live worker of the model has
acknowledged, or names those that did not in time. The latest weights command of a model is also
kept in `mlxq:weights:<model>`, and every adapter published for it in `mlxq:adapters:<model>` (adapter
name -> ControlCommand JSON), so a worker that starts, or comes back, catches up with them.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, computed_field

WeightPolicy = Literal["drain", "abort", "inflight"]
PauseMode = Literal["keep", "abort"]
ControlOp = Literal["weights", "pause", "resume", "abort", "reset_prefix_cache", "adapter"]

# Weights streamed through Redis go in chunks of at most this many bytes (a Redis value should stay
# well under its 512 MB limit, and one call under a second on a slow link).
WEIGHT_CHUNK_BYTES = 8 * 1024 * 1024


class WeightFile(BaseModel):
    """One file of a published version (safetensors) or adapter (and its adapter_config.json), as
    streamed through Redis."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+\.(safetensors|json)$")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    chunks: int = Field(ge=1)


class ControlCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    op: ControlOp
    model: str = Field(min_length=1, max_length=512)
    issued_at: float
    # op "weights": the version, where its safetensors are (a directory the workers can read, or
    # files streamed through Redis under `blob_prefix`), and how running sequences meet the swap.
    version: Optional[int] = Field(None, ge=0, lt=2**53)
    path: Optional[str] = None
    blob_prefix: Optional[str] = None
    files: Optional[list[WeightFile]] = None
    policy: Optional[WeightPolicy] = None
    # op "pause": keep running sequences frozen until resume, or abort them back to their queues.
    mode: Optional[PauseMode] = None
    # op "abort": one job (else every job the worker runs for this model).
    job_id: Optional[str] = None
    # op "adapter": the LoRA adapter's name (its files: `path` or `blob_prefix` and `files`, as for weights).
    adapter: Optional[str] = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:/-]+$")


class ControlAck(BaseModel):
    model_config = ConfigDict(extra="ignore")

    worker: str
    ok: bool
    message: str = ""
    weight_version: Optional[int] = None  # the worker's version once it applied the command
    at: float = 0.0
    seconds: Optional[float] = None  # from the command's arrival at the worker to its acknowledgement


class ControlOutcome(BaseModel):
    """What a control call returns: who applied the command, who failed it, who did not answer."""

    command: ControlCommand
    acked: dict[str, ControlAck] = {}
    missing: list[str] = []  # live workers of the model that did not acknowledge in time
    # A weights or adapter command no worker accepted and at least one refused: taken back out of
    # `mlxq:weights:<model>` / `mlxq:adapters:<model>` (what it replaced is there again), so no
    # worker that starts later fetches it.
    withdrawn: bool = False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """At least one worker acknowledged, every live worker of the model did in time, and each said ok."""
        return bool(self.acked) and not self.missing and all(ack.ok for ack in self.acked.values())

    @property
    def errors(self) -> dict[str, str]:
        return {name: ack.message for name, ack in self.acked.items() if not ack.ok}
