"""What each live worker says about itself (`mlxq:worker:<name>`), for the gateway's model list,
`mlxq stats` and operators: the model it serves, its queues, how busy it is.

A worker refreshes its entry every heartbeat interval, busy or idle, with a TTL of its heartbeat
TTL, and scores its name in the sorted set `mlxq:workers` with the time of that refresh. A reader
takes the names scored within `PRESENCE_WINDOW_S` and reads their entries; a name whose entry expired is gone.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

# Readers take the names scored this recently in `mlxq:workers` and the entries' expiry decides who is
# live; a worker prunes only names older than this, since other workers' TTLs may be longer than its own.
PRESENCE_WINDOW_S = 3600


class WorkerPresence(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer workers may say more

    name: str
    alias: Optional[str] = None  # the name requests use in `model`
    # The model's hub id, when it was loaded from one; never a local path (paths are the host's own).
    model_id: Optional[str] = None
    kind: Literal["text", "vision", "fake"] = "text"
    queues: list[str] = []
    group: Optional[str] = None
    host: str = ""
    pid: int = 0
    max_num_seqs: int = 0
    running: int = 0  # jobs in flight (admitted, decoding or waiting for memory)
    sequences: int = 0  # sequences decoding
    weight_version: Optional[int] = None
    started_at: float = 0.0  # Unix seconds
    heartbeat_at: float = 0.0  # Unix seconds of this refresh
    ttl_s: int = 0  # the entry expires this long after heartbeat_at

    @property
    def served_names(self) -> list[str]:
        return [n for n in dict.fromkeys((self.alias, self.model_id)) if n]
