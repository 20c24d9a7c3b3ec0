"""Errors after which the accelerator's context is gone for this process.

CUDA keeps some errors "sticky": after an illegal memory access every later call in the process fails
too (seen on the H200: docs/performance.md#the-real-model-on-the-h200). Re-running the batch's jobs
alone, the answer to any other failed step, would then fail every job the worker ever takes. The worker
hands its jobs back instead and its process exits, so that a fresh process gets a fresh context.
"""

from __future__ import annotations

from typing import Optional

# Lower-case pieces of the messages of CUDA's sticky errors (cudaErrorIllegalAddress,
# cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorAssert, cudaErrorIllegalInstruction,
# cudaErrorHardwareStackError, cudaErrorLaunchTimeout), as the CUDA runtime words them.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert triggered",
    "an illegal instruction was encountered",
    "hardware stack error",
    "the launch timed out and was terminated",
)

# A process that exits with this code lost its device; `mlxq worker --processes N` starts it again.
DEVICE_LOST_EXIT_CODE = 75


class DeviceLost(RuntimeError):
    """The engine's device failed so that nothing more can run on it in this process."""


def device_lost_reason(exc: BaseException) -> Optional[str]:
    """The sticky device error `exc` reports (its message), or None if it is not one."""
    message = str(exc)
    lowered = message.lower()
    if any(piece in lowered for piece in STICKY_CUDA_ERRORS):
        return message
    return None
