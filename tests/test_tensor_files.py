"""The safetensors check a weight version or adapter passes before mlx loads it (worker/tensor_files.py):
whatever it accepts, mlx loads, every float finite; whatever else it refuses with TensorFileError,
naming the file and the tensor, and never raises anything else."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import worker  # noqa: F401  (OpenBLAS before MLX)
from worker.tensor_files import TensorFileError, check_tensor_file


def saved(path: Path, **tensors) -> Path:
    import mlx.core as mx

    mx.save_safetensors(str(path), tensors)
    return path


def parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def rewrite(path: Path, header: dict, data: bytes) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_found_in_every_float_dtype(tmp_path, dtype, value):
    import mlx.core as mx

    values = mx.zeros((3, 1000), dtype=getattr(mx, dtype))
    values[2, 17] = value
    path = saved(tmp_path / "w.safetensors", fine=mx.ones((4,)), bad=values)
    with pytest.raises(TensorFileError, match=r"w.safetensors: tensor 'bad' holds values that are not finite .* 2017\)"):
        check_tensor_file(path)
    saved(path, fine=mx.ones((4,)), large=mx.full((5,), 6e4, dtype=getattr(mx, dtype)), ints=mx.arange(9))
    assert set(check_tensor_file(path).tensors) == {"fine", "large", "ints"}


def test_ranges_that_lie_are_refused_before_mlx_reads_them(tmp_path):
    import mlx.core as mx

    path = saved(tmp_path / "w.safetensors", a=mx.ones((8, 8)), b=mx.ones((8, 8)), c=mx.ones((3,)))
    header, data = parts(path)
    cases = {
        "exceed the file's": (header, data[:-8]),
        "overlap": ({**header, "b": {**header["b"], "data_offsets": header["a"]["data_offsets"]}}, data),
        "which takes 12 bytes": ({**header, "c": {**header["c"], "data_offsets": [0, 8]}}, data),
        "no valid data_offsets": ({**header, "c": {**header["c"], "data_offsets": [9, 3]}}, data),
        "no valid shape": ({**header, "c": {**header["c"], "shape": [-3]}}, data),
        "no dtype MLX reads": ({**header, "c": {**header["c"], "dtype": "F64"}}, data),
    }
    for needle, (bad_header, bad_data) in cases.items():
        rewrite(path, bad_header, bad_data)
        with pytest.raises(TensorFileError, match=needle):
            check_tensor_file(path)
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(TensorFileError, match="not a safetensors header"):
        check_tensor_file(path)


MUTATIONS = st.lists(st.tuples(st.sampled_from(["a", "b", "c", "__metadata__", "d"]),
                               st.sampled_from(["dtype", "shape", "data_offsets", "drop"]),
                               st.one_of(st.integers(-3, 400), st.sampled_from(["F32", "BF16", "I8", "F64", "x"]),
                                         st.lists(st.integers(-2, 300), max_size=3), st.none())),
                     max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=MUTATIONS, cut=st.integers(0, 40), poison=st.integers(0, 200))
def test_whatever_passes_the_check_loads_in_mlx_with_finite_values(tmp_path, mutations, cut, poison):
    import mlx.core as mx

    path = saved(tmp_path / "w.safetensors", a=mx.ones((4, 4)), b=mx.ones((4, 4), dtype=mx.bfloat16),
                 c=mx.arange(6, dtype=mx.int32))
    header, data = parts(path)
    for name, field, value in mutations:
        entry = header.setdefault(name, {}) if name != "__metadata__" else {}
        if isinstance(entry, dict):
            if field == "drop":
                entry.clear()
            else:
                entry[field] = value
    data = bytearray(data[:len(data) - cut])
    if poison < len(data):
        data[poison] = 0xFF  # maybe the top byte of a float: NaN
    rewrite(path, header, bytes(data))
    try:
        checked = check_tensor_file(path)
    except TensorFileError:
        return
    loaded = mx.load(str(path))
    assert set(loaded) == set(checked.tensors)
    for name, array in loaded.items():
        if mx.issubdtype(array.dtype, mx.floating):
            assert mx.all(mx.isfinite(array)).item(), name
