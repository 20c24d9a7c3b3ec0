"""Processes the harness starts (workers, servers, drivers), and facts about the machine.

Every process goes through a `ProcessSet`, whose `stop_all` ends them (SIGTERM, then SIGKILL);
the runner calls it on success, on errors and on Ctrl-C.
"""

from __future__ import annotations

import http.client
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Optional, Sequence


class ProcessSet:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})})
        finally:
            log.close()  # the child holds its own descriptor
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self._procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 20.0
        for proc in list(self._procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def __enter__(self) -> "ProcessSet":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop_all()


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def interrupt_on_signals() -> None:
    """Let SIGTERM unwind like Ctrl-C, so that the cleanup in `finally` blocks runs; and take
    SIGINT back even where a launcher left it ignored (a background job of a script)."""

    def handler(signum: int, frame: Optional[FrameType]) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, handler)


def wait_http_ok(host: str, port: int, path: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {path} answered")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                conn.close()
                return
            conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"http://{host}:{port}{path} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.25)


def library_loaded(pid: int, library_path: Optional[str]) -> Optional[bool]:
    """Whether process `pid` has mapped `library_path` (Linux only; None where it cannot tell)."""
    if not library_path or not sys.platform.startswith("linux"):
        return None
    target = os.path.realpath(library_path)
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return target in maps or library_path in maps


def resolve_model(model: Optional[str], shape: str, dtype: str, cache: Optional[Path]) -> tuple[str, dict[str, Any]]:
    """The model path to benchmark; builds the random-weight `shape` model once, in a cache dir. A
    .gguf file is benchmarked as its converted mlx-lm directory (worker/gguf.py), which every arm loads."""
    if model and model.lower().endswith(".gguf"):
        from worker.gguf import converted_directory

        directory = str(converted_directory(Path(model)))
        return directory, {"path": directory, "source": model, "gguf": model}
    if model:
        return model, {"path": model, "source": model}
    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxq" / "bench-models"
    path = root / (shape if dtype == "float32" else f"{shape}-{dtype}")
    if not (path / "config.json").exists():
        print(f"building the random-weight {shape} {dtype} model in {path} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "mlxq", "make-tiny-model", str(path), "--shape", shape,
                        "--dtype", dtype], check=True, stdout=subprocess.DEVNULL)
    return str(path), {"path": str(path), "source": f"random weights, {shape} shape, {dtype} (mlxq make-tiny-model)"}


def model_facts(path: str) -> dict[str, Any]:
    import json

    facts: dict[str, Any] = {}
    config = Path(path) / "config.json"
    if config.exists():
        data = json.loads(config.read_text())
        for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "torch_dtype"):
            if key in data:
                facts[key] = data[key]
    weights = list(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if weights:
        facts["weights_bytes"] = sum(w.stat().st_size for w in weights)
    return facts


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import psutil

        facts["memory_bytes"] = psutil.virtual_memory().total
        facts["cpu_count_physical"] = psutil.cpu_count(logical=False)
    except ImportError:
        pass
    if sys.platform.startswith("linux"):
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return facts


def versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    found: dict[str, Optional[str]] = {}
    for name in ("mlxq", "mlx", "mlx-lm", "rq", "redis", "transformers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def redis_server_version(url: str) -> Optional[str]:
    import redis

    try:
        conn = redis.Redis.from_url(url)
        info = conn.info("server")
        conn.close()
        return str(info.get("redis_version"))
    except Exception:
        return None


def prepared_copy(path: str, cache: Optional[Path]) -> tuple[str, list[str]]:
    """The model at `path` in the weight formats a worker serves it in on this device
    (worker/weight_prep.py), saved once as a model directory for the peers that load a directory as
    it is (mlx_lm.server, vllm-mlx), so every arm computes with the same weights; `path` itself
    where a worker changes nothing. Also what was done, in words."""
    from mlx_lm.utils import load_model, load_tokenizer, save

    from worker.weight_prep import current_platform, prepare_weights

    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxq" / "bench-models"
    model, config = load_model(Path(path))
    report = prepare_weights(model)
    if not report.notes:
        return path, []
    target = root / "prepared" / f"{Path(path).name}-{current_platform()}"
    if not (target / "config.json").exists():
        if report.dequantized:
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        if report.upcast:
            config["torch_dtype"] = "float32"
        print(f"saving the model as a worker serves it on this device in {target} (once)", flush=True)
        save(target, path, model, load_tokenizer(Path(path)), config)
    return str(target), report.notes
