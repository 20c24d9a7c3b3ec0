"""What a worker will run: the job function and the RQ callbacks a job names.

Checked on every path that could run either: the batch worker's admission (a refused job ends
failed at once, never retried, and none of its callbacks run) and the dead-worker sweep, which
strips a refused callback from the job hash before rq's registry cleanup would call it. A stock
`rq worker` checks neither, which is why mlxq documents none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from rq.exceptions import DeserializationError
from rq.job import Job

from schemas import keys
from worker.intake import describe_deserialization_error

ALLOWED_FUNCTIONS = frozenset({keys.JOB_FUNCTION})
CALLBACK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")


@dataclass(frozen=True)
class Refusal:
    """Why a job may not run here. Refusals are deterministic: a retry would be refused again."""

    error_type: str
    message: str


def callbacks(fields: Mapping[bytes, bytes]) -> dict[str, str]:
    """The callbacks a job hash names (rq imports and calls them by these paths), by field."""
    named = {field: fields.get(field.encode()) for field in CALLBACK_FIELDS}
    return {field: name.decode(errors="replace") for field, name in named.items() if name}


def callback_names(fields: Mapping[bytes, bytes]) -> list[str]:
    return list(callbacks(fields).values())


def allowed(name: str, allowlist: Sequence[str]) -> bool:
    return any(name.startswith(prefix) for prefix in allowlist)


def refused_callbacks(names: Sequence[str], allowlist: Sequence[str]) -> list[str]:
    return [name for name in names if not allowed(name, allowlist)]


def refusal(job: Job, callbacks: Sequence[str], allowlist: Sequence[str]) -> Optional[Refusal]:
    """Why this job may not run here, or None. Nothing is ever unpickled or imported."""
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError as exc:
        return Refusal("DeserializationError", describe_deserialization_error(exc))
    if func_name not in ALLOWED_FUNCTIONS:
        return Refusal("FunctionNotAllowed",
                       f"function {func_name!r} is not on this worker's allowlist {sorted(ALLOWED_FUNCTIONS)}")
    if args or not isinstance(kwargs, dict) or set(kwargs) != {"request"}:
        return Refusal("InvalidRequest", f"{keys.JOB_FUNCTION} takes exactly one keyword argument, `request`")
    refused = refused_callbacks(callbacks, allowlist)
    if refused:
        return Refusal("CallbackNotAllowed",
                       f"callback {refused[0]!r} is not allowed on this worker (MLXQ_CALLBACK_ALLOWLIST)")
    return None
