"""mlxq producer: what a web backend installs to enqueue, poll, wait for and cancel jobs.

Imports no MLX and nothing from `worker`.
"""

from producer.client import Client
from producer.errors import BrokerError, InvalidRequest, JobNotFound, MlxqError, WaitTimeout
from schemas import GenerationRequest, GenerationResult, RequestLimits

__all__ = [
    "BrokerError",
    "Client",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequest",
    "JobNotFound",
    "MlxqError",
    "RequestLimits",
    "WaitTimeout",
]
