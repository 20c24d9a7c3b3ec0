"""`python -m mlxq.bench.blas_run MODULE [ARGS...]`: run MODULE as `python -m MODULE ARGS...`
would, after `import worker` has pointed MLX at the BLAS the mlxq worker uses (Linux CPU), so a
peer such as mlx_lm.server is measured with the same BLAS as mlxq."""

from __future__ import annotations

import runpy
import sys

import worker  # noqa: F401  (preloads the BLAS before anything imports mlx)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m mlxq.bench.blas_run MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
