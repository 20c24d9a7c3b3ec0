"""Every Redis key and queue name mlxq uses, in one place.

The `mlxq:result:`, `mlxq:stream:` and `mlxq:cancel:` keys are the public contract
(CONTRACT.md). The project's own: `mlxq:done:<id>`, a pub/sub channel the worker publishes a
job id on right after its result key is written, so waiters block instead of polling;
`mlxq:running:<worker>`, the set of job ids a worker is running; and `mlxq:stats:<worker>`, a hash
of the worker's engine counters (e.g. the prefix cache's), values as strings.
"""

from __future__ import annotations

import re

PREFIX = "mlxq:"
DEFAULT_QUEUE = "mlxq"
JOB_FUNCTION = "worker.tasks.generate"
SERIALIZER = "rq.serializers.JSONSerializer"

# Contract: a job that did not set result_ttl keeps its result key this long (RQ's default).
DEFAULT_RESULT_TTL = 500


def result_key_ttl(job_result_ttl: int | None) -> int | None:
    """Seconds a result key lives: the job's result_ttl, RQ's default (500 s) when unset, None (no
    expiry) for -1. result_ttl=0 ("keep nothing", only from jobs enqueued by other tools) becomes
    1 s, long enough for a woken waiter to read it."""
    if job_result_ttl is None:
        return DEFAULT_RESULT_TTL
    return None if job_result_ttl < 0 else max(job_result_ttl, 1)


def failure_ttl(job_failure_ttl: int | None, job_result_ttl: int | None) -> int:
    """Seconds RQ keeps a failed or cancelled job's records (its hash with the request, its
    `rq:results:<id>` entry, its failed-registry entry): the job's own `failure_ttl` if it set one,
    else as long as its result key lives (-1: forever), never RQ's default of a year."""
    if job_failure_ttl is not None:
        return job_failure_ttl
    ttl = result_key_ttl(job_result_ttl)
    return -1 if ttl is None else ttl


def result_key(job_id: str) -> str:
    return f"{PREFIX}result:{job_id}"


def stream_key(job_id: str) -> str:
    return f"{PREFIX}stream:{job_id}"


def wake_key(token: str) -> str:
    """A stream private to one AsyncClient's stream reader (a random token names it): an entry added
    there wakes the reader's blocking read (producer/stream_hub.py)."""
    return f"{PREFIX}wake:{token}"


def cancel_key(job_id: str) -> str:
    return f"{PREFIX}cancel:{job_id}"


def retry_claim_key(job_id: str) -> str:
    """Held for a moment by the worker putting a due retry back on its queue (worker/retry_policy.py)."""
    return f"{PREFIX}retrying:{job_id}"


def done_channel(job_id: str) -> str:
    return f"{PREFIX}done:{job_id}"


def running_key(worker_name: str) -> str:
    """The ids of the jobs a worker is running (its per-step cancellation check reads it)."""
    return f"{PREFIX}running:{worker_name}"


def group_key(group: str) -> str:
    """A hash of the live workers of one group (`mlxq worker --processes N`), name -> Redis time of
    its last poll: they share waiting jobs out among themselves."""
    return f"{PREFIX}group:{group}"


def stats_key(worker_name: str) -> str:
    """A hash of a worker's engine counters (its prefix cache's `stats()` fields, as strings)."""
    return f"{PREFIX}stats:{worker_name}"


def worker_key(worker_name: str) -> str:
    """A live worker's WorkerPresence JSON (schemas/presence.py); expires with its heartbeat TTL."""
    return f"{PREFIX}worker:{worker_name}"


# Held (with a short TTL) by the one worker that sweeps dead workers' jobs and runs rq's registry
# maintenance at a time: two sweeps of the same expired job would each send it back (worker/recovery.py).
SWEEP_LOCK_KEY = f"{PREFIX}sweeping"

# A sorted set of worker names, scored with the Unix time of each one's last presence refresh.
WORKERS_KEY = f"{PREFIX}workers"

# A stream of fleet samples, one per interval, the last minutes of them: the gateway's /dashboard
# charts (producer/fleet_history.py).
HISTORY_KEY = f"{PREFIX}history"


def control_stream(model: str) -> str:
    """The commands to the workers of one model (schemas/control.py), a Redis stream."""
    return f"{PREFIX}control:{model}"


def ack_key(command_id: str) -> str:
    """Each worker's acknowledgement of one control command: worker name -> ControlAck JSON."""
    return f"{PREFIX}ack:{command_id}"


def weights_key(model: str) -> str:
    """The latest weights command of a model (ControlCommand JSON), for workers that catch up."""
    return f"{PREFIX}weights:{model}"


def adapters_key(model: str) -> str:
    """Every adapter published for a model (a hash: adapter name -> ControlCommand JSON), for workers that catch up."""
    return f"{PREFIX}adapters:{model}"


def paused_key(model: str) -> str:
    """Set while a model's workers are paused (its value the pause mode), for workers that start then."""
    return f"{PREFIX}paused:{model}"


def blob_key(prefix: str, file_name: str, chunk: int) -> str:
    """One chunk of a safetensors file streamed through Redis for a weight version."""
    return f"{PREFIX}blob:{prefix}:{file_name}:{chunk}"


def queue_for_model(model: str | None) -> str:
    """The contract's routing: `mlxq:<model>` when a model is named, else `mlxq`."""
    return f"{PREFIX}{model}" if model else DEFAULT_QUEUE


# Priorities, highest first, as `rq worker high default low` orders its queues: "default" is the
# contract's queue itself, any other priority P a sibling queue `<queue>@P`.
DEFAULT_PRIORITY = "default"
DEFAULT_PRIORITIES = ("high", DEFAULT_PRIORITY, "low")


def priority_queue(queue: str, priority: str | None) -> str:
    """The queue a job of `priority` goes to instead of `queue` (`mlxq:qwen@high`); "default" or None: `queue`."""
    return queue if priority in (None, DEFAULT_PRIORITY) else f"{queue}@{priority}"


_PRIORITY_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


def check_priorities(priorities: tuple[str, ...], name: str = "priorities") -> None:
    """ValueError naming `name` unless `priorities` are distinct short names that include "default"."""
    bad = [p for p in priorities if not _PRIORITY_NAME.match(p)]
    if bad:
        raise ValueError(f"{name}: priority names are 1-32 letters, digits, '-' or '_', got {bad}")
    if len(set(priorities)) != len(priorities):
        raise ValueError(f"{name}: a priority is listed twice in {list(priorities)}")
    if DEFAULT_PRIORITY not in priorities:
        raise ValueError(f"{name}: must include {DEFAULT_PRIORITY!r} (the contract's queues), got {list(priorities)}")


def prioritized_queues(queues: list[str], priorities: tuple[str, ...]) -> list[str]:
    """What a worker listens on, in order: each priority's queue of every one of `queues`, highest first
    (`[a@high, b@high, a, b, a@low, b@low]`), so a higher priority always goes first, as in rq."""
    return [priority_queue(queue, priority) for priority in priorities for queue in queues]


def model_alias(model: str) -> str:
    """The worker's default alias for a model path or hub id: its last path component; for a
    .gguf file, the file's stem."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
