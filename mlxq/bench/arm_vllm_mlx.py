"""Arm E: vllm-mlx 0.6.0's `BatchedEngine`, from a separate venv (it pins mlx-lm < 0.32, which
mlxq's own venv cannot share). `--create-venv` builds that venv: the vllm-mlx wheel without its
dependency list, then only what its text `BatchedEngine` path imports, with mlx pinned to the
version mlxq runs (the same MLX kernels on both sides). Its full list would add torchvision (and
so torch), gradio, opencv, mlx-vlm, mlx-embeddings and mcp, none of which that path imports.

All workloads run in one driver process (`vllm_mlx_driver.py`), like a server process would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from mlxq.bench.arms import Arm, ArmSkipped, OnOutcome, Outcome, Plan
from mlxq.bench.procs import ProcessSet, log_tail
from mlxq.bench.workloads import RequestRecord, Workload

VLLM_MLX_VERSION = "0.6.0"
# vllm-mlx 0.6.0's own requirements, less its UI / vision / audio / tooling stack (see above).
TEXT_ENGINE_REQUIREMENTS = (
    "mlx-lm>=0.31.3,<0.32", "transformers>=5.0.0", "tokenizers>=0.19.0", "huggingface-hub>=0.23.0",
    "numpy>=1.24.0", "pillow>=10.0.0", "tqdm>=4.66.0", "pyyaml>=6.0", "requests>=2.28.0",
    "jsonschema>=4.0.0", "psutil>=5.9.0", "tabulate>=0.9.0", "pytz>=2024.1",
)
DRIVER = Path(__file__).with_name("vllm_mlx_driver.py")


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def create_venv(venv: Path, log: Path) -> None:
    """Build the venv; raises RuntimeError with pip's last lines when a step fails."""
    from importlib import metadata

    mlx_version = metadata.version("mlx")
    mlx_req = f"mlx[cpu]=={mlx_version}" if sys.platform.startswith("linux") else f"mlx=={mlx_version}"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv_python(venv)), "-m", "pip", "install", "--no-deps", f"vllm-mlx=={VLLM_MLX_VERSION}"],
        [str(venv_python(venv)), "-m", "pip", "install", mlx_req, *TEXT_ENGINE_REQUIREMENTS],
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        for argv in steps:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"`{' '.join(argv[:5])} ...` failed:\n{log_tail(log, 8)}")


def check_venv(venv: Path) -> dict[str, Any]:
    python = venv_python(venv)
    if not python.exists():
        raise ArmSkipped(f"no vllm-mlx venv at {venv}: pass --create-venv to build it")
    code = ("import json, importlib.metadata as m, vllm_mlx.engine.batched; "
            "print(json.dumps({n: m.version(n) for n in ('vllm-mlx', 'mlx', 'mlx-lm')}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise ArmSkipped(f"vllm-mlx does not import in {venv}: {done.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _workload_json(workload: Workload) -> dict[str, Any]:
    return {"kind": workload.kind, "requests": [
        {"index": r.index, "ids": list(r.prompt.ids), "max_tokens": r.max_tokens, "client": r.client,
         "arrival_s": r.arrival_s} for r in workload.requests]}


class VllmMlxArm(Arm):
    key = "E"
    methods = {
        "queue": "not observable through BatchedEngine's public API",
        "ttft": "request added to the first streamed output with completion_tokens >= 1",
        "e2e": "request added to the end of its output stream",
        "eos": "a logits processor adding -1e9 to the EOS logits (its API has no ignore_eos)",
    }

    def __init__(self, model: str, venv: Optional[Path], create: bool, max_num_seqs: int, prefill_batch_size: int,
                 procs: ProcessSet, timeout_s: float, blas_path: Optional[str]) -> None:
        self.model = model
        self.venv = venv
        self.create = create
        self.max_num_seqs = max_num_seqs
        self.prefill_batch_size = prefill_batch_size
        self.procs = procs
        self.timeout_s = timeout_s
        self.blas_path = blas_path
        self._info: dict[str, Any] = {}

    def start(self) -> None:
        if self.venv is None:
            raise ArmSkipped("no --vllm-mlx-venv given (add --create-venv to build one)")
        if not venv_python(self.venv).exists() and self.create:
            print(f"building the vllm-mlx venv in {self.venv} (once)", flush=True)
            try:
                create_venv(self.venv, self.procs.log_dir / "vllm-mlx-venv.log")
            except RuntimeError as exc:
                raise ArmSkipped(f"could not build the vllm-mlx venv: {exc}") from None
        self._info = {"venv": str(self.venv), "versions": check_venv(self.venv),
                      "install": "vllm-mlx --no-deps + its text-engine requirements (see arm_vllm_mlx.py)"}

    def info(self) -> dict[str, Any]:
        return self._info

    def run(self, workload: Workload, warmup: Optional[Workload]) -> list[RequestRecord]:
        outcome = self._drive([(workload, warmup)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def run_all(self, plan: Plan, on_outcome: OnOutcome) -> None:
        """All workloads in one driver process (one model load, like a server)."""
        for (workload, _), outcome in zip(plan, self._drive(plan)):
            on_outcome(workload, outcome)

    def _drive(self, plan: Plan) -> list[Outcome]:
        assert self.venv is not None
        work = self.procs.log_dir / "vllm-mlx"
        work.mkdir(parents=True, exist_ok=True)
        spec = {
            "model": self.model, "blas_path": self.blas_path, "max_num_seqs": self.max_num_seqs,
            "prefill_batch_size": self.prefill_batch_size, "timeout_s": self.timeout_s,
            "plan": [{"label": w.label, "workload": _workload_json(w),
                      "warmup": _workload_json(warm) if warm is not None else None} for w, warm in plan],
        }
        (work / "spec.json").write_text(json.dumps(spec))
        out = work / "out.json"
        out.unlink(missing_ok=True)
        proc = self.procs.start("vllm-mlx-driver", [str(venv_python(self.venv)), str(DRIVER),
                                                     str(work / "spec.json"), str(out)])
        try:
            code = proc.wait(timeout=self.timeout_s * max(1, len(plan)) + 600)
        finally:
            self.procs.stop(proc)
        if code != 0 or not out.exists():
            error = RuntimeError(f"vllm-mlx driver exited with {code}:\n"
                                 f"{log_tail(self.procs.log_dir / 'vllm-mlx-driver.log', 10)}")
            return [error for _ in plan]
        data = json.loads(out.read_text())
        self._info.update(blas_loaded=data.get("blas_loaded"), scheduler_config=data.get("scheduler_config"),
                          eos_masked=data.get("eos_masked"), versions=data.get("versions"))
        outcomes: list[Outcome] = []
        for item in data["results"]:
            if item["error"]:
                outcomes.append(RuntimeError(item["error"]))
            else:
                outcomes.append(sorted((RequestRecord.from_json(r) for r in item["records"]), key=lambda r: r.index))
        return outcomes
