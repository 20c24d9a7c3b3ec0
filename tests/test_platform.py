"""Platform branches: the Linux BLAS preload and the macOS Metal limits, each unit-tested here
(no Mac is available; the Metal branch runs against a stand-in for mx's Metal calls)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from worker import platform as plat
from worker.settings import WorkerSettings


@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.setattr(plat, "_blas_choice", None)


def test_macos_never_preloads_a_linux_blas(fresh_choice, monkeypatch):
    loaded = []
    monkeypatch.setattr(plat.ctypes, "CDLL", lambda *a, **k: loaded.append(a))
    choice = plat.preload_blas("auto", platform="darwin")
    assert loaded == [] and "Accelerate" in choice.name and choice.path is None


def test_off_keeps_the_bundled_blas(fresh_choice, monkeypatch):
    monkeypatch.setattr(plat.ctypes, "CDLL", lambda *a, **k: pytest.fail("must not load"))
    assert "MLXQ_BLAS=off" in plat.preload_blas("off", platform="linux").name


def test_too_late_once_mlx_is_imported(fresh_choice, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx.core", types.ModuleType("mlx.core"))
    assert "imported before" in plat.preload_blas("auto", platform="linux").name


def test_explicit_path_that_cannot_load_is_an_error(fresh_choice, monkeypatch):
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    with pytest.raises(RuntimeError, match="MLXQ_BLAS=/nope/libblas.so"):
        plat.preload_blas("/nope/libblas.so", platform="linux")


@pytest.mark.skipif(sys.platform != "linux", reason="the preload is a Linux-only branch")
def test_preload_makes_mlx_use_openblas_in_a_fresh_process():
    """In a fresh process `import worker` picks OpenBLAS and MLX's matmul really runs through it:
    the process maps libopenblas, and matmul beats the bundled BLAS by a wide margin."""
    if not any(__import__("os").path.exists(p) for p in plat.OPENBLAS_CANDIDATES):
        pytest.fail("OpenBLAS is not installed: `make test` installs libopenblas0-pthread")
    code = textwrap.dedent(
        """
        import worker, sys
        from worker.platform import preload_blas
        import mlx.core as mx
        a = mx.ones((64, 64)); mx.eval(a @ a)
        maps = open('/proc/self/maps').read()
        print(preload_blas().name, 'openblas' in maps)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("OpenBLAS") and out.strip().endswith("True"), out
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "MLXQ_BLAS": "off"}).stdout
    assert "MLXQ_BLAS=off" in off and off.strip().endswith("False"), off


def test_blas_threads_leave_a_platform_blas_alone(monkeypatch):
    monkeypatch.setattr(plat.ctypes, "CDLL", lambda *a, **k: pytest.fail("must not load"))
    assert plat.limit_blas_threads(1, plat.BlasChoice("platform default (Accelerate on macOS)")) is None


def test_blas_threads_need_an_openblas():
    with pytest.raises(RuntimeError, match="MLXQ_BLAS_THREADS=2: libc.so.6 has no openblas_set_num_threads"):
        plat.limit_blas_threads(2, plat.BlasChoice("libc", "libc.so.6"))


def test_blas_threads_setting_is_checked():
    assert WorkerSettings.from_env({"MLXQ_BLAS_THREADS": "3"}).blas_threads == 3
    with pytest.raises(ValueError, match="MLXQ_BLAS_THREADS must be >= 1"):
        WorkerSettings.from_env({"MLXQ_BLAS_THREADS": "0"})


@pytest.mark.skipif(sys.platform != "linux", reason="the preload is a Linux-only branch")
def test_worker_caps_openblas_threads_in_a_fresh_process(tmp_path):
    """`load_model` with MLXQ_BLAS_THREADS=1 leaves the preloaded OpenBLAS running one thread
    (it starts with one per core)."""
    from worker.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    code = textwrap.dedent(
        f"""
        import ctypes, worker
        from worker.loading import load_model
        from worker.platform import preload_blas
        from worker.settings import WorkerSettings
        get = ctypes.CDLL(preload_blas().path).openblas_get_num_threads
        before = get()
        load_model(WorkerSettings.from_env(model={str(model)!r}))
        default = get()
        load_model(WorkerSettings.from_env(model={str(model)!r}, blas_threads=1))
        print(before, default, get())
        """
    )
    env = {**__import__("os").environ, "OPENBLAS_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["2", "2", "1"], out


class FakeMx:
    def __init__(self, metal: bool) -> None:
        self.calls: list[tuple[str, int]] = []
        self.metal = types.SimpleNamespace(is_available=lambda: metal)

    def set_wired_limit(self, n: int) -> None:
        self.calls.append(("wired", n))

    def set_cache_limit(self, n: int) -> None:
        self.calls.append(("cache", n))


@pytest.mark.parametrize("platform_name, metal, expected", [
    ("darwin", True, [("wired", 1024 * 1024 * 1024), ("cache", 256 * 1024 * 1024)]),
    ("darwin", False, []),
    ("linux", True, []),
])
def test_metal_limits_apply_only_on_a_mac_gpu(monkeypatch, platform_name, metal, expected):
    fake = FakeMx(metal)
    monkeypatch.setitem(sys.modules, "mlx.core", fake)
    monkeypatch.setitem(sys.modules, "mlx", types.SimpleNamespace(core=fake))
    monkeypatch.setattr(plat.sys, "platform", platform_name)
    applied = plat.apply_metal_limits(1024, 256)
    assert fake.calls == expected
    assert len(applied) == len(expected)


def test_settings_from_env_and_flags():
    env = {"MLXQ_MODEL": "org/Some-Model-4bit", "MLXQ_MAX_NUM_SEQS": "64", "MLXQ_METAL_WIRED_LIMIT_MB": "8192",
           "MLXQ_CALLBACK_ALLOWLIST": "app.hooks., other.", "MLXQ_TRUST_REMOTE_CODE": "true"}
    settings = WorkerSettings.from_env(env, max_num_seqs=16)
    assert settings.max_num_seqs == 16  # a flag beats the environment
    assert settings.metal_wired_limit_mb == 8192
    assert settings.callback_allowlist == ("app.hooks.", "other.")
    assert settings.trust_remote_code is True
    assert settings.served_alias == "Some-Model-4bit"
    assert settings.default_queues() == ["mlxq:Some-Model-4bit", "mlxq"]
    assert settings.served_names() == {"org/Some-Model-4bit", "Some-Model-4bit"}
    assert WorkerSettings.from_env({"MLXQ_MODEL": "m", "MLXQ_ALIAS": "fast"}).default_queues() == ["mlxq:fast", "mlxq"]
    with pytest.raises(ValueError, match="MLXQ_MAX_NUM_SEQS"):
        WorkerSettings.from_env({"MLXQ_MAX_NUM_SEQS": "lots"})
    with pytest.raises(ValueError, match="MLXQ_MAX_NUM_SEQS must be >= 1"):
        WorkerSettings.from_env({"MLXQ_MAX_NUM_SEQS": "0"})


def test_cuda_kernels_launch_directly_on_linux_unless_the_variable_is_set():
    environ: dict[str, str] = {}
    assert plat.launch_cuda_kernels_directly(environ, platform="linux") and environ == {"MLX_USE_CUDA_GRAPHS": "0"}
    chosen = {"MLX_USE_CUDA_GRAPHS": "1"}
    assert not plat.launch_cuda_kernels_directly(chosen, platform="linux") and chosen == {"MLX_USE_CUDA_GRAPHS": "1"}
    on_mac: dict[str, str] = {}
    assert not plat.launch_cuda_kernels_directly(on_mac, platform="darwin") and on_mac == {}


def test_float32_matmuls_stay_float32_unless_the_variable_is_set():
    environ: dict[str, str] = {}
    assert plat.keep_float32_matmuls_in_float32(environ) and environ == {"MLX_ENABLE_TF32": "0"}
    assert not plat.float32_matmuls_round(environ)
    chosen = {"MLX_ENABLE_TF32": "1"}
    assert not plat.keep_float32_matmuls_in_float32(chosen) and chosen == {"MLX_ENABLE_TF32": "1"}
    assert plat.float32_matmuls_round(chosen) and plat.float32_matmuls_round({})


def test_importing_the_worker_keeps_float32_matmuls_in_float32_before_mlx():
    import os

    code = "import os, worker, mlx.core; print(os.environ.get('MLX_ENABLE_TF32'))"
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_importing_the_worker_sets_direct_cuda_launches_before_mlx():
    import os

    code = "import os, worker, mlx.core; print(os.environ.get('MLX_USE_CUDA_GRAPHS'))"
    env = {k: v for k, v in os.environ.items() if k != "MLX_USE_CUDA_GRAPHS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("0" if sys.platform == "linux" else "None")


@pytest.mark.parametrize("platform_name, cpu, expected", [("linux", True, True), ("linux", False, False),
                                                          ("darwin", True, False), ("darwin", False, False),
                                                          ("win32", True, False)])
def test_exp_goes_through_power_only_on_a_linux_cpu(platform_name, cpu, expected):
    assert plat.exp_through_power(cpu, platform_name) is expected
