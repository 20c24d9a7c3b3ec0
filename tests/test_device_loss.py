"""Which engine errors mean the device is gone for the process (worker/engines/device_loss.py)."""

import pytest

from worker.engines.device_loss import device_lost_reason


@pytest.mark.parametrize("message", [
    "cudaMemcpy(data, buf.data, buf.size, kind) failed: an illegal memory access was encountered",
    "[cuda] kernel launch failed: unspecified launch failure",
    "CUDA error: misaligned address",
    "CUDA error: device-side assert triggered",
    "cudaStreamSynchronize failed: the launch timed out and was terminated",
])
def test_cudas_sticky_errors_mean_the_device_is_lost(message):
    assert device_lost_reason(RuntimeError(message)) == message


@pytest.mark.parametrize("message", [
    "fake engine: injected step failure",
    "[cuda::malloc] Failed to allocate 4096 bytes: out of memory",  # freed memory makes it run again
    "[METAL] Command buffer execution failed: Caused GPU Timeout Error",  # not a sticky CUDA error: the per-request recovery takes it
    "Shapes (2,3) and (4,5) cannot be broadcast.",
])
def test_other_errors_leave_the_device_usable(message):
    assert device_lost_reason(RuntimeError(message)) is None
