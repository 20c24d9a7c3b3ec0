"""Build a small random-weight model directory offline: the test and demo fixture.

The directory has the layout of a hub model (config.json, model.safetensors, tokenizer
files with a chat template), so it goes through the same `mlx_lm.load` path as real models.
`arch` picks the architecture (mlx-lm's model class and the config fields it reads): llama by
default, or one of ARCHITECTURES.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# ChatML, the template most small instruct models ship.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A message queue carries jobs from web servers
to workers, and each worker batches many requests on one accelerator. Redis keeps the queue,
the results and the streams of tokens. Tokens are sampled one step at a time; a batch of
sequences shares each forward pass. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation ,.;:!?
Hello world! How are you today? Write a short poem about the sea. Explain continuous batching.
"""


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(64, 2, 128, 4, 2, 512),
    # SmolLM-135M's dimensions: the CPU benchmark model.
    "smollm-135m": ModelShape(576, 30, 1536, 9, 3, 49152),
    # Qwen2.5-0.5B's dimensions (as a llama): the GPU benchmark model.
    "qwen2.5-0.5b": ModelShape(896, 24, 4864, 14, 2, 151936),
}


# mlx-lm model module and the config fields beyond the common ones, per architecture (`arch`).
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0}),
    "mistral": ("llama", {"architectures": ["MistralForCausalLM"], "rope_theta": 10000.0}),
    "qwen2": ("qwen2", {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0}),
    "qwen3": ("qwen3", {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0}),
    "gemma": ("gemma", {"architectures": ["GemmaForCausalLM"], "rope_theta": 10000.0}),
    "gemma2": ("gemma2", {"architectures": ["Gemma2ForCausalLM"], "rope_theta": 10000.0,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "query_pre_attn_scalar": 16}),
    # Every layer but each sliding_window_pattern-th attends to a sliding window (RotatingKVCache).
    "gemma3_text": ("gemma3_text", {"architectures": ["Gemma3ForCausalLM"], "rope_theta": 1000000.0,
                                    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16,
                                    "sliding_window": 8, "sliding_window_pattern": 2}),
}


def _train_tokenizer(vocab_size: int):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # A small corpus yields fewer merges than asked: pad with unused tokens so that
    # len(tokenizer) == vocab_size and every id the model can emit decodes.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(
    path: str | Path, *, shape: str = "tiny", dtype: str = "float32", seed: int = 0, arch: str = "llama",
    num_key_value_heads: int | None = None,
) -> Path:
    """Write a random-weight model of architecture `arch` (llama unless given) to `path` and
    return it. `num_key_value_heads` overrides the shape's (grouped-query attention or not)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: unknown architecture {arch!r} (one of {', '.join(ARCHITECTURES)})")
    module_name, extra = ARCHITECTURES[arch]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    dims = SHAPES[shape]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(dims.vocab_size)
    if len(tokenizer) != dims.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {dims.vocab_size}")
    tokenizer.save_pretrained(str(out))

    config = {
        "model_type": arch,
        "hidden_size": dims.hidden_size,
        "num_hidden_layers": dims.num_hidden_layers,
        "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": num_key_value_heads or dims.num_key_value_heads,
        "head_dim": dims.hidden_size // dims.num_attention_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": dims.vocab_size,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        **extra,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "torch_dtype": dtype,
    }
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
