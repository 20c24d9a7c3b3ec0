"""The mlxq worker: an RQ worker class with a continuous-batching MLX engine behind it.

Importing this package first points MLX at an optimized BLAS on Linux (it must happen
before `mlx.core` is imported anywhere in the process), for its CUDA backend at direct
kernel launches, and keeps float32 matrix products in float32; see worker/platform.py.
"""

import os as _os

from worker.platform import keep_float32_matmuls_in_float32 as _keep_float32_matmuls_in_float32
from worker.platform import launch_cuda_kernels_directly as _launch_cuda_kernels_directly
from worker.platform import preload_blas as _preload_blas

_preload_blas(_os.environ.get("MLXQ_BLAS", "auto"))
_launch_cuda_kernels_directly()
_keep_float32_matmuls_in_float32()

from worker.rq_worker import BatchWorker  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402

__all__ = ["BatchWorker", "WorkerSettings"]
