"""Weight formats at load, per platform (worker/weight_prep.py): the CPU branch upcasts bfloat16 and
float16 to float32 and dequantizes, CUDA dequantizes in the checkpoint's own precision, Metal keeps
everything; each step can be turned off, and dequantizing waits for memory. Every branch runs
here on the CPU (the plan is chosen by the platform's name; the arrays are the same)."""

from __future__ import annotations

import logging

import pytest

import worker  # noqa: F401  (BLAS before MLX)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from worker.weight_prep import WeightPlan, current_platform, plan_weights, prepare_weights, quantized_layers

HALVES = ("float16", "bfloat16")
TOKENS = mx.array([[5, 17, 99, 3, 250, 7, 42, 11]])


@pytest.fixture(scope="module")
def half_model_dirs(tmp_path_factory) -> dict[str, str]:
    from worker.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("half-models")
    return {dtype: str(make_tiny_model(root / dtype, dtype=dtype)) for dtype in HALVES}


def _load(path: str, quantized: bool = False):
    from mlx_lm import load

    model, _ = load(path)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)  # scales and biases in the model's dtype, as mlx-community's
        mx.eval(model.parameters())
    return model


def _dtypes(model) -> set[str]:
    return {str(a.dtype).removeprefix("mlx.core.") for _, a in tree_flatten(model.parameters())
            if mx.issubdtype(a.dtype, mx.floating)}


def test_each_platform_has_its_plan():
    assert plan_weights("cpu") == WeightPlan(upcast=True, dequantize=True)
    assert plan_weights("cuda") == WeightPlan(upcast=False, dequantize=True)
    assert plan_weights("metal") == WeightPlan(upcast=False, dequantize=False)
    assert plan_weights("cpu", upcast=False, keep_quantized=True) == WeightPlan(upcast=False, dequantize=False)
    assert plan_weights("metal", upcast=True, keep_quantized=False) == WeightPlan(upcast=False, dequantize=False)
    with pytest.raises(ValueError, match="unknown platform"):
        plan_weights("tpu")
    assert current_platform() == "cpu"  # this machine


@pytest.mark.parametrize("dtype", HALVES)
def test_the_cpu_upcasts_half_precision_exactly(half_model_dirs, dtype):
    model = _load(half_model_dirs[dtype])
    before = {name: a for name, a in tree_flatten(model.parameters())}
    half_logits = model(TOKENS)
    report = prepare_weights(model, "cpu")
    assert report.upcast and not report.dequantized
    assert report.notes == [f"{len(before)} {dtype} tensors upcast to float32 "
                            f"(+{sum(a.nbytes for a in before.values()) / 2**20:.0f} MiB; MLXQ_UPCAST=0 keeps them)"]
    assert _dtypes(model) == {"float32"}
    for name, array in tree_flatten(model.parameters()):
        assert mx.array_equal(array.astype(getattr(mx, dtype)), before[name]), name  # every value kept
        assert mx.array_equal(array, before[name].astype(mx.float32)), name
    logits = model(TOKENS)
    assert logits.dtype == mx.float32
    assert float(mx.abs(logits - half_logits.astype(mx.float32)).max()) < 0.1  # the same model, more precise


@pytest.mark.parametrize("dtype", HALVES)
def test_the_cpu_dequantizes_to_float32_what_the_quantized_kernels_compute(half_model_dirs, dtype):
    model = _load(half_model_dirs[dtype], quantized=True)
    quantized = dict(quantized_layers(model))
    assert quantized  # every linear layer and the embedding
    expected = {name: mx.dequantize(m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                                    m.group_size, m.bits) for name, m in quantized.items()}
    reference = _load(half_model_dirs[dtype], quantized=True)
    reference.set_dtype(mx.float32)  # float32 scales, still quantized: what the CPU computed before
    report = prepare_weights(model, "cpu")
    assert report.upcast and report.dequantized
    assert any(f"{len(quantized)} quantized layers dequantized" in note for note in report.notes)
    assert not quantized_layers(model) and _dtypes(model) == {"float32"}
    layers = dict(model.named_modules())
    for name, weight in expected.items():
        assert mx.array_equal(layers[name].weight, weight), name
    assert mx.allclose(model(TOKENS), reference(TOKENS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", HALVES)
def test_cuda_dequantizes_in_the_checkpoints_precision(half_model_dirs, dtype):
    model = _load(half_model_dirs[dtype], quantized=True)
    expected = {name: mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
                for name, m in quantized_layers(model)}
    report = prepare_weights(model, "cuda", free_bytes=1 << 40)
    assert not report.upcast and report.dequantized
    assert not quantized_layers(model) and _dtypes(model) == {dtype}
    layers = dict(model.named_modules())
    assert all(mx.array_equal(layers[name].weight, weight) for name, weight in expected.items())


def test_metal_keeps_quantized_and_half_precision_weights(half_model_dirs):
    model = _load(half_model_dirs["float16"], quantized=True)
    count = len(quantized_layers(model))
    report = prepare_weights(model, "metal", free_bytes=1 << 40)
    assert not report.upcast and not report.dequantized
    assert report.notes == [f"{count} quantized layers kept quantized (metal)"]
    assert len(quantized_layers(model)) == count and _dtypes(model) == {"float16"}


def test_each_step_can_be_turned_off(half_model_dirs):
    model = _load(half_model_dirs["bfloat16"], quantized=True)
    count = len(quantized_layers(model))
    report = prepare_weights(model, "cpu", upcast=False, keep_quantized=True)
    assert report.notes == [f"{count} quantized layers kept quantized (MLXQ_KEEP_QUANTIZED)"]
    assert len(quantized_layers(model)) == count and _dtypes(model) == {"bfloat16"}


def test_dequantizing_waits_for_memory(half_model_dirs):
    model = _load(half_model_dirs["float16"], quantized=True)
    count = len(quantized_layers(model))
    report = prepare_weights(model, "cpu", free_bytes=1 << 10)  # the dense copy needs more than half of 1 KiB
    assert report.upcast and not report.dequantized and len(quantized_layers(model)) == count
    assert "kept quantized: dequantizing needs" in report.notes[-1] and "of the 0.0 GiB free" in report.notes[-1]


def test_a_float32_model_is_left_alone(tiny_model_dir):
    model = _load(tiny_model_dir)
    report = prepare_weights(model, "cpu")
    assert report.notes == [] and _dtypes(model) == {"float32"}


def test_the_worker_logs_what_it_did_to_the_weights(half_model_dirs, caplog):
    from worker.loading import load_model
    from worker.settings import WorkerSettings

    with caplog.at_level(logging.INFO, logger="mlxq.worker"):
        model, _ = load_model(WorkerSettings(model=half_model_dirs["bfloat16"]))
    assert _dtypes(model) == {"float32"}
    assert any(r.message.startswith("weights: ") and "bfloat16 tensors upcast to float32" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    with caplog.at_level(logging.INFO, logger="mlxq.worker"):
        kept, _ = load_model(WorkerSettings(model=half_model_dirs["bfloat16"], upcast=False))
    assert _dtypes(kept) == {"bfloat16"}


def test_free_memory_is_read_per_platform(monkeypatch):
    from worker.weight_prep import available_memory_bytes

    assert available_memory_bytes("cpu") > 0  # the host's available RAM
    monkeypatch.setattr(mx, "device_info", lambda: {"free_memory": 123, "total_memory": 1000})
    assert available_memory_bytes("cuda") == 123
    monkeypatch.setattr(mx, "device_info", lambda: {"memory_size": 1000})
    monkeypatch.setattr(mx, "get_active_memory", lambda: 100)
    assert available_memory_bytes("metal") == 900


def test_an_upcast_model_takes_weight_versions_in_the_checkpoints_precision(half_model_dirs, tmp_path):
    """A trainer publishes what it trains (bfloat16); the CPU worker serves float32: the version is
    accepted and cast up exactly, and a version of another shape or dtype is still refused."""
    import numpy as np

    from worker.engines.weight_swap import WeightsError, parameter_spec, swap_into
    from worker.weights import check_files

    model = _load(half_model_dirs["bfloat16"])
    prepare_weights(model, "cpu")
    spec = parameter_spec(model)
    assert {dtype for dtype, _ in spec.values()} == {"float32|bfloat16|float16"}
    version = {name: (a * 2).astype(mx.bfloat16) for name, a in tree_flatten(model.parameters())}
    mx.save_safetensors(str(tmp_path / "v.safetensors"), version)
    check_files([tmp_path / "v.safetensors"], spec)
    swap_into(model, [tmp_path / "v.safetensors"])
    assert _dtypes(model) == {"float32"}
    for name, array in tree_flatten(model.parameters()):
        assert np.array_equal(np.array(array), np.array(version[name].astype(mx.float32))), name
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), {**version, "model.norm.weight": mx.zeros((3,), mx.int32)})
    with pytest.raises(WeightsError, match=r"model\.norm\.weight.*int32, the model \(64,\) float32 or bfloat16"):
        check_files([tmp_path / "bad.safetensors"], spec)
    exact = _load(half_model_dirs["bfloat16"])
    prepare_weights(exact, "cpu", upcast=False)  # served as it is: versions must match exactly
    assert {dtype for dtype, _ in parameter_spec(exact).values()} == {"bfloat16"}
