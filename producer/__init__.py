"""mlxq producer: what a web backend installs to enqueue, poll, wait for, stream and cancel jobs,
with a sync `Client` and its asyncio twin `AsyncClient`.

Imports no MLX and nothing from `worker`.
"""

from producer.aio import AsyncClient
from producer.client import Client
from producer.errors import (BrokerError, InvalidRequest, JobNotFound, MlxqError, NoLiveWorker, NotDurable, StreamExpired,
                             WaitTimeout)
from producer.presence import LiveModel
from schemas import GenerationRequest, GenerationResult, RequestLimits

__all__ = [
    "AsyncClient",
    "BrokerError",
    "Client",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequest",
    "JobNotFound",
    "LiveModel",
    "MlxqError",
    "NoLiveWorker",
    "NotDurable",
    "RequestLimits",
    "StreamExpired",
    "WaitTimeout",
]
