"""GGUF files as mlx-lm model directories.

MLX reads a GGUF file itself (`mx.load(path, return_metadata=True)`): F32 and F16 tensors as
they are, Q4_0, Q4_1 and Q8_0 ones as MLX's own affine-quantized triples (weight, scales, biases;
group size 32). A llama-architecture file of those types is converted once into a directory of the
layout mlx-lm loads (config.json, model.safetensors, tokenizer.json and its config, with the chat
template), kept in a cache keyed by the file, so every consumer of a model directory (the worker,
`mlxq bench`, mlx_lm.server) loads it the same way. Any other tensor type (the K-quants and
I-quants, which MLX does not read: it returns garbage for them) is refused before anything is
loaded, naming the type and how to convert.

What the conversion undoes: llama.cpp stores the rows of Q and K in its rotary layout (within
each head, the two halves of the head dimension interleaved); mlx-lm's llama expects the Hugging
Face order. The tokenizer is rebuilt from the file's metadata (worker/gguf_tokenizer.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Optional

log = logging.getLogger("mlxq.worker")

# ggml's tensor type numbers (ggml.h), by name; MLX reads the first five.
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
              18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
              26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
READABLE_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
HOW_TO_CONVERT = ("re-quantize it to a type MLX reads with llama.cpp (`llama-quantize --allow-requantize IN.gguf "
                  "OUT.gguf Q8_0`, or Q4_0), or convert the original Hugging Face model with "
                  "`mlx_lm.convert --hf-path ... [-q]` and serve that directory")
# Bump when the converted directory's contents change: older cache entries are then rebuilt.
CONVERTER_VERSION = 2

# GGUF metadata value types (the GGUF spec) and the struct format of the fixed-size ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file mlxq cannot serve; the message names what and how to convert it."""


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's ggml type name, from the file's header alone (nothing is loaded)."""
    try:
        with path.open("rb") as file:
            magic, version = file.read(4), _read(file, "<I")
            if magic != b"GGUF":
                raise GGUFError(f"{path.name}: not a GGUF file (it starts {magic!r})")
            if version < 2:
                raise GGUFError(f"{path.name}: GGUF version {version} is too old (2 and 3 are read)")
            tensors, entries = _read(file, "<Q"), _read(file, "<Q")
            for _ in range(entries):
                _skip_string(file)
                _skip_value(file, _read(file, "<I"))
            types = {}
            for _ in range(tensors):
                name = _read_string(file)
                dims = _read(file, "<I")
                file.seek(8 * dims, os.SEEK_CUR)
                kind = _read(file, "<I")
                file.seek(8, os.SEEK_CUR)  # offset
                types[name] = GGML_TYPES.get(kind, f"type {kind}")
            return types
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise GGUFError(f"{path.name}: not a readable GGUF file ({exc})") from None


def check_gguf(path: Path) -> dict[str, str]:
    """Refuse a file with a tensor type MLX does not read (GGUFError names the type, the tensors
    and how to convert); returns each tensor's type."""
    types = tensor_types(path)
    unreadable: dict[str, list[str]] = {}
    for name, kind in types.items():
        if kind not in READABLE_TYPES:
            unreadable.setdefault(kind, []).append(name)
    if unreadable:
        kinds = ", ".join(f"{kind} ({len(names)} tensors, e.g. {names[0]})" for kind, names in unreadable.items())
        raise GGUFError(f"{path.name}: tensor type {kinds} cannot be served: MLX reads only "
                        f"{', '.join(READABLE_TYPES)} from a GGUF file; {HOW_TO_CONVERT}")
    return types


def converted_directory(path: Path, cache_root: Optional[Path] = None) -> Path:
    """The mlx-lm model directory of the GGUF file at `path`: from the cache, or converted into it
    now (written to a temporary folder, then renamed, so a crash leaves no half of one)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    types = check_gguf(path)
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    root = cache_root or default_cache_root()
    target = root / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=root))
    try:
        convert(path, scratch, types)
        try:
            scratch.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("converted %s into %s in %.1f s", path.name, target, time.perf_counter() - started)
    return target


def default_cache_root() -> Path:
    base = os.environ.get("MLXQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxq")
    return Path(base) / "gguf"


def convert(path: Path, into: Path, types: dict[str, str]) -> None:
    """Write the model directory of the (checked) GGUF file at `path` into `into`."""
    import mlx.core as mx

    from worker.gguf_tokenizer import save_tokenizer

    tensors, metadata = mx.load(str(path), return_metadata=True)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise GGUFError(f"{path.name}: architecture {architecture!r}: mlxq serves llama-architecture GGUF files; "
                        "convert the original Hugging Face model with `mlx_lm.convert` and serve that directory")
    config = model_config(metadata, tensors, types)
    weights = {}
    for name, array in tensors.items():
        weights[hf_name(name)] = _unpermute(name, array, config)
    mx.save_safetensors(str(into / "model.safetensors"), weights, metadata={"format": "mlx"})
    (into / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(metadata, into)


def model_config(metadata: dict[str, Any], tensors: dict[str, Any], types: dict[str, str]) -> dict[str, Any]:
    """mlx-lm's llama config from the file's llama.* metadata."""
    def number(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise GGUFError(f"the GGUF metadata has no llama.{key}")
        return value.item() if hasattr(value, "item") else value

    heads = int(number("attention.head_count"))
    hidden = int(number("embedding_length"))
    vocab = metadata.get("llama.vocab_size")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(number("block_count")),
        "intermediate_size": int(number("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(number("attention.head_count_kv", heads)),
        "head_dim": int(number("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(number("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(number("context_length", 4096)),
        "vocab_size": int(vocab.item()) if vocab is not None else len(metadata["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        # MLX reads F16 tensors, and the scales of quantized ones, as float16
        "torch_dtype": "float32" if set(types.values()) == {"F32"} else "float16",
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if f"tokenizer.ggml.{name}_token_id" in metadata:
            config[key] = int(metadata[f"tokenizer.ggml.{name}_token_id"].item())
    quantized = [kind for kind in types.values() if kind.startswith("Q")]
    if quantized:
        # The common type's bits; each layer's own are read from its tensors' shapes when loading.
        common = max(set(quantized), key=quantized.count)
        config["quantization"] = {"group_size": 32, "bits": 8 if common == "Q8_0" else 4}
    return config


_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """`blk.3.attn_q.scales` -> `model.layers.3.self_attn.q_proj.scales`."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise GGUFError(f"tensor {name!r} is not one of a llama model's")


def _unpermute(name: str, array: Any, config: dict[str, Any]) -> Any:
    """Q and K rows back in the Hugging Face order: llama.cpp interleaved each head's two halves
    ((heads, 2, half) stored as (heads, half, 2)). Scales and biases are per row, so they move
    with their rows."""
    parts = name.split(".")
    if len(parts) != 4 or parts[2] not in ("attn_q", "attn_k"):
        return array
    heads = config["num_attention_heads"] if parts[2] == "attn_q" else config["num_key_value_heads"]
    rows, cols = array.shape
    return array.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _read(file: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = file.read(size)
    if len(data) != size:
        raise struct.error("the file ends inside its header")
    return struct.unpack(fmt, data)[0]


def _read_string(file: BinaryIO) -> str:
    return file.read(_read(file, "<Q")).decode()


def _skip_string(file: BinaryIO) -> None:
    file.seek(_read(file, "<Q"), os.SEEK_CUR)


def _skip_value(file: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        file.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _STRING:
        _skip_string(file)
    elif kind == _ARRAY:
        element, count = _read(file, "<I"), _read(file, "<Q")
        if element in _SCALARS:
            file.seek(struct.calcsize(_SCALARS[element]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(file, element)
    else:
        raise struct.error(f"unknown metadata value type {kind}")
