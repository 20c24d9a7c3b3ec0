"""Safetensors files checked whole before anything loads them: the header, every tensor's byte range
(inside the file, the length its shape and dtype need, no two overlapping), and every floating-point
value finite.

mlx's own loader raises RuntimeError (not a ValueError) on a range past the end of the file, and
takes two tensors that read the same bytes, or NaN and infinite values, without a word: a version
or an adapter is read here first, on the weights thread, with NumPy over bounded chunks of the file,
so nothing is held whole and the batch loop never waits on it (docs/rl.md).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors' dtype names: MLX's name for each, and its size in bytes.
DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2), "I8": ("int8", 1),
          "U8": ("uint8", 1), "I16": ("int16", 2), "U16": ("uint16", 2), "I32": ("int32", 4), "U32": ("uint32", 4),
          "I64": ("int64", 8), "U64": ("uint64", 8), "BOOL": ("bool", 1)}
MAX_HEADER_BYTES = 100 * 1024 * 1024
SCAN_CHUNK_BYTES = 16 * 1024 * 1024  # read this much of a tensor at a time when checking its values
_BF16_EXPONENT = 0x7F80  # all exponent bits set: infinite or NaN


class TensorFileError(ValueError):
    """A safetensors file that must not be loaded; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors' name (F32, BF16, ...)
    shape: tuple[int, ...]
    begin: int  # byte range in the data section, [begin, end)
    end: int

    @property
    def mlx_dtype(self) -> str:
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class TensorFile:
    path: Path
    data_start: int  # where the data section begins in the file
    tensors: dict[str, TensorEntry]


def read_header(path: Path) -> TensorFile:
    """The file's tensors, from its header, each byte range checked against the file's size and the
    others (nothing but the header is read)."""
    try:
        with path.open("rb") as file:
            size = path.stat().st_size
            (length,) = struct.unpack("<Q", file.read(8))
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise TensorFileError(f"{path.name}: a header of {length} bytes in a file of {size} is not a "
                                      "safetensors header")
            header = json.loads(file.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TensorFileError(f"{path.name}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path.name}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    tensors = {name: _entry(path, name, raw, data_bytes) for name, raw in header.items()}
    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for before, after in zip(ordered, ordered[1:]):
        if after.begin < before.end:
            raise TensorFileError(f"{path.name}: tensors {before.name!r} and {after.name!r} overlap (bytes "
                                  f"{before.begin}..{before.end} and {after.begin}..{after.end})")
    return TensorFile(path, 8 + length, tensors)


def _entry(path: Path, name: str, raw: object, data_bytes: int) -> TensorEntry:
    if not isinstance(raw, dict) or not isinstance(raw.get("dtype"), str) or raw["dtype"] not in DTYPES:
        raise TensorFileError(f"{path.name}: tensor {name!r} has no dtype MLX reads")
    shape, offsets = raw.get("shape", []), raw.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise TensorFileError(f"{path.name}: tensor {name!r} has no valid shape ({shape!r})")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise TensorFileError(f"{path.name}: tensor {name!r} has no valid data_offsets ({offsets!r})")
    begin, end = offsets
    if end > data_bytes:
        raise TensorFileError(f"{path.name}: tensor {name!r}: its bytes {begin}..{end} exceed the file's "
                              f"{data_bytes} bytes of data (the file is cut short, or its header lies)")
    needed = math.prod(shape) * DTYPES[raw["dtype"]][1]
    if end - begin != needed:
        raise TensorFileError(f"{path.name}: tensor {name!r}: {end - begin} bytes for shape {shape} "
                              f"{raw['dtype']}, which takes {needed} bytes")
    return TensorEntry(name, raw["dtype"], tuple(shape), begin, end)


def check_values(tensor_file: TensorFile) -> None:
    """Every floating-point value finite (no NaN, no infinity), read a chunk at a time."""
    with tensor_file.path.open("rb") as file:
        for entry in tensor_file.tensors.values():
            if entry.dtype not in ("F32", "F16", "BF16"):
                continue
            item = DTYPES[entry.dtype][1]
            step = SCAN_CHUNK_BYTES - SCAN_CHUNK_BYTES % item
            file.seek(tensor_file.data_start + entry.begin)
            for start in range(entry.begin, entry.end, step):
                chunk = file.read(min(step, entry.end - start))
                if len(chunk) != min(step, entry.end - start):
                    raise TensorFileError(f"{tensor_file.path.name}: tensor {entry.name!r}: the file ended while "
                                          "it was read (it changed after its header was checked)")
                bad = _first_not_finite(chunk, entry.dtype)
                if bad is not None:
                    index = (start - entry.begin) // item + bad
                    raise TensorFileError(f"{tensor_file.path.name}: tensor {entry.name!r} holds values that are "
                                          f"not finite (NaN or infinite; the first at flat index {index})")


def _first_not_finite(chunk: bytes, dtype: str) -> int | None:
    import numpy as np  # here, not at import: `import worker` must not load numpy's BLAS (worker/platform.py)

    if dtype == "BF16":
        bits = np.frombuffer(chunk, dtype="<u2")
        flagged = (bits & _BF16_EXPONENT) == _BF16_EXPONENT
    else:
        flagged = ~np.isfinite(np.frombuffer(chunk, dtype="<f4" if dtype == "F32" else "<f2"))
    if not flagged.any():
        return None
    return int(np.argmax(flagged))


def check_tensor_file(path: Path) -> TensorFile:
    """`read_header` and `check_values`: the file is safe to load."""
    tensor_file = read_header(path)
    check_values(tensor_file)
    return tensor_file
