"""The compiled decode step's kernels, built by a background process while the worker serves.

The first run of a compiled step builds its fused kernels: on the CPU each is a C++ shared library
(a compiler run of a second or more), on CUDA an NVRTC program; MLX keeps both on disk (in
`$TMPDIR/mlx/<version>/`), so any later process finds them. Building them in the worker's own
process would stall its batch: MLX evaluates one graph at a time, so a compile on another thread
holds the engine's steps back for as long as it runs. A separate, low-priority process builds
them instead, on a copy of the model with its first two layers only (the layers repeat, so their
kernels are the same) and the served weights' formats, one (slots, length) shape at a time,
reporting each shape it finished. Until a shape is reported, the engine runs that step uncompiled;
then it compiles the shape itself, which with the kernels on disk costs about one step
(docs/engine.md, "Start-up"). With speculative decoding on, it also builds the verification pass's
kernels (after the first two shapes), and the engine proposes nothing until it has.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Optional, Sequence

log = logging.getLogger("mlxq.engine")

PREBUILD_LAYERS = 2  # a copy with this many layers has every kernel of the full model


class KernelPrebuild:
    """Owns the prebuilding process and the thread that reads its reports: which shapes are ready."""

    def __init__(self, model_dir: str, shapes: Sequence[tuple[int, int]], *, upcast: bool, keep_quantized: bool,
                 grouped_mask: bool, verify_widths: Sequence[int] = ()) -> None:
        self.shapes = list(shapes)
        self._ready: set[tuple[int, int]] = set()
        self._verify_built = not verify_widths
        self._started = time.perf_counter()
        self.finished_after: Optional[float] = None  # seconds from start to the process's end
        self.failure: Optional[str] = None
        spec = {"model": model_dir, "shapes": self.shapes, "upcast": upcast, "keep_quantized": keep_quantized,
                "grouped_mask": grouped_mask, "verify_widths": list(verify_widths), "parent": os.getpid()}
        # At the lowest priority from its first thread on (BLAS starts its threads when it loads): the
        # worker's steps come first, this process takes the CPU they leave. It stays in the worker's
        # session: Linux shares the CPU fairly between sessions (autogroups) whatever their nice values.
        nice = [path, "-n", "19"] if (path := shutil.which("nice")) else []
        self._process = subprocess.Popen(
            [*nice, sys.executable, "-m", "worker.engines.kernel_prebuild", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout,), name="mlxq-kernel-prebuild",
                                         daemon=True)
        self._reader.start()
        atexit.register(self.stop)

    def ready(self, shape: tuple[int, int]) -> bool:
        """Whether `shape` compiles now without building kernels: the process built it, or it ended
        (it built every shape it was given; one it was not given shares their kernels), or failed
        (then compiling is all that is left)."""
        return shape in self._ready or self.finished_after is not None

    @property
    def verify_ready(self) -> bool:
        """Whether a verification pass compiles now without building kernels (as `ready`)."""
        return self._verify_built or self.finished_after is not None

    @property
    def done(self) -> bool:
        return self.finished_after is not None

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def _read(self, stream: Optional[IO[str]]) -> None:
        assert stream is not None
        lines = []
        for line in stream:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ready":
                self._ready.add((int(parts[1]), int(parts[2])))
            elif parts == ["ready", "verify"]:
                self._verify_built = True
            else:
                lines.append(line.rstrip())
        code = self._process.wait()
        if code < 0:  # stopped by a signal: the worker is stopping
            log.info("decode step kernels: the prebuilding process was stopped (signal %d)", -code)
        elif code != 0:
            self.failure = f"exit status {code}: {' | '.join(lines[-5:])}"
            log.warning("decode step kernels: the prebuilding process failed (%s); shapes compile when first needed",
                        self.failure)
        else:
            log.info("decode step kernels: %d shapes prebuilt by a background process in %.1f s",
                     len(self._ready), time.perf_counter() - self._started)
        self.finished_after = time.perf_counter() - self._started


def served_formats(model: Any) -> tuple[bool, bool]:
    """(upcast, keep_quantized): the settings that give a fresh copy of the model the served one's
    weight formats (worker/weight_prep.py): no half-precision tensor left means upcast, a
    quantized layer left means kept quantized."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from worker.weight_prep import quantized_layers

    halves = any(a.dtype in (mx.float16, mx.bfloat16) for _, a in tree_flatten(model.parameters()))
    return not halves, bool(quantized_layers(model))


def prebuild(spec: dict[str, Any], out: IO[str]) -> None:
    """The process's work: the copy of the model, then each shape's step (the verification pass's
    widths after the first two, which hold every kernel of one slot and of several) and one lone prefill."""
    import worker  # noqa: F401  (the worker's BLAS, before MLX)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from worker.engines.decode_step import DecodeStep
    from worker.engines.speculation.verify_step import VerifyStep
    from worker.engines.slot_cache import KVLayout
    from worker.weight_prep import prepare_weights

    model, _ = load_model(_local_path(spec["model"]), lazy=True, strict=False,
                          model_config={"num_hidden_layers": PREBUILD_LAYERS})
    prepare_weights(model, upcast=spec["upcast"], keep_quantized=spec["keep_quantized"], free_bytes=1 << 62)
    layout = KVLayout.of(model)
    step = DecodeStep(model, spec["grouped_mask"])
    for index, (slots, length) in enumerate(spec["shapes"]):
        if os.getppid() != spec["parent"]:
            return  # the worker is gone
        step.warm_up(layout, [(slots, length)])
        print(f"ready {slots} {length}", file=out, flush=True)
        if index == 1 and spec.get("verify_widths"):
            verify = VerifyStep(model, spec["grouped_mask"])
            for verify_slots, verify_length in spec["shapes"][:2]:
                verify.warm_up(layout, verify_slots, verify_length, spec["verify_widths"])
            print("ready verify", file=out, flush=True)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 16), dtype=mx.uint32), cache=cache))


def _local_path(model: str) -> Path:
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="build the compiled decode step's kernels (run by the worker)")
    parser.add_argument("spec", help="JSON: model, shapes, upcast, keep_quantized, grouped_mask")
    args = parser.parse_args(argv)
    prebuild(json.loads(args.spec), sys.stdout)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
