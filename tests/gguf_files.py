"""GGUF files for tests, written with llama.cpp's own Python package (`gguf`): a model directory as
llama.cpp's converter would write it (Q and K rows in its rotary order, the tokenizer in the
metadata), in one tensor type, and a file with a tensor type MLX does not read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Hugging Face llama names -> GGUF names (llama.cpp's tensor map, for the tensors a llama has).
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def rotary_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of Q and K rows (each head's two halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(model_dir: Path, out: Path, kind: str = "F32") -> Path:
    """The llama model in `model_dir` (float32 safetensors, byte-level BPE tokenizer) as a GGUF
    file whose matrices are of type `kind` (F32, F16, Q8_0, Q4_0, Q4_1; norms stay F32)."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    config = json.loads((model_dir / "config.json").read_text())
    described = json.loads((model_dir / "tokenizer.json").read_text())
    template = (model_dir / "chat_template.jinja").read_text()
    weights = {name: np.array(array) for name, array in mx.load(str(model_dir / "model.safetensors")).items()}

    writer = GGUFWriter(str(out), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = described["model"]["vocab"]
    special = {t["id"] for t in described["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in described["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(template)

    qtype = GGMLQuantizationType[kind]
    for name, array in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            array = rotary_order(array, heads)
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), array.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    _finish(writer)
    return out


def write_unreadable_gguf(out: Path, kind: str = "Q4_K") -> Path:
    """A GGUF file with one llama tensor of type `kind` (its bytes zero), and one readable one."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quant_shape_to_byte_shape

    qtype = GGMLQuantizationType[kind]
    writer = GGUFWriter(str(out), "llama")
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros(quant_shape_to_byte_shape((8, 256), qtype), np.uint8),
                      raw_dtype=qtype)
    _finish(writer)
    return out


def _finish(writer) -> None:  # noqa: ANN001
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
