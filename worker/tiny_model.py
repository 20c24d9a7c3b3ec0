"""Build a small random-weight model directory offline: the test and demo fixture.

The directory has the layout of a hub model (config.json, model.safetensors, tokenizer
files with a chat template), so it goes through the same `mlx_lm.load` path as real models;
the vision one (`make_tiny_vision_model`, a qwen2_vl) through `mlx_vlm.load`. For text models,
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
    # Qwen2.5-7B's dimensions (as a llama, embeddings tied): the GPU weight-format comparison. Building
    # it takes ~45 GB of memory (float32 initialisation, then the dtype asked) and 15 GB of disk in bf16.
    "qwen2.5-7b": ModelShape(3584, 28, 18944, 28, 4, 152064),
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


def _train_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS,
                     chat_template: str = CHAT_TEMPLATE):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # A small corpus yields fewer merges than asked: pad the vocabulary with unused entries so that
    # len(tokenizer) == vocab_size and every id the model can emit decodes. Plain vocabulary entries,
    # not added tokens: tokenizer consumers (llguidance) special-case added tokens one by one.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        described = json.loads(tokenizer.to_str())
        vocab = described["model"]["vocab"]
        first = max(vocab.values()) + 1
        vocab.update({f"<|extra_{i}|>": first + i for i in range(missing)})
        tokenizer = Tokenizer.from_str(json.dumps(described))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=chat_template,
    )


def make_tiny_model(
    path: str | Path, *, shape: str = "tiny", dtype: str = "float32", seed: int = 0, arch: str = "llama",
    num_key_value_heads: int | None = None, extra_special_tokens: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE, tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a random-weight model of architecture `arch` (llama unless given) to `path` and
    return it. `num_key_value_heads` overrides the shape's (grouped-query attention or not);
    `extra_special_tokens` (e.g. think tags) join the tokenizer's, `chat_template` replaces ChatML.
    `tokenizer_from` (a model directory or .gguf file) gives it that model's tokenizer instead, and a
    vocabulary of its size: a draft model for speculative decoding of that model (docs/speculative.md)."""
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
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        from worker.loading import model_directory

        tokenizer = AutoTokenizer.from_pretrained(model_directory(str(tokenizer_from)))
        dims = ModelShape(dims.hidden_size, dims.num_hidden_layers, dims.intermediate_size, dims.num_attention_heads,
                          dims.num_key_value_heads, len(tokenizer))
    else:
        tokenizer = _train_tokenizer(dims.vocab_size, SPECIAL_TOKENS + list(extra_special_tokens), chat_template)
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
        "bos_token_id": tokenizer.bos_token_id if tokenizer_from else tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id if tokenizer_from else tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "torch_dtype": dtype,
    }
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# Qwen2-VL's image tokens and the ChatML template with its image placeholder (one per image part).
VISION_SPECIAL_TOKENS = SPECIAL_TOKENS + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VisionShape:
    text: ModelShape
    mrope_section: tuple[int, int, int]  # sums to the text head_dim / 2
    depth: int  # vision transformer blocks
    embed_dim: int
    num_heads: int
    max_pixels: int  # the image processor resizes every image to at most this many pixels
    min_pixels: int = 28 * 28 * 4


VISION_SHAPES: dict[str, VisionShape] = {
    # 28 x 28 pixels make one image token; an image is 4 to 16 of them.
    "tiny": VisionShape(SHAPES["tiny"], (2, 3, 3), depth=2, embed_dim=32, num_heads=2, max_pixels=28 * 28 * 16),
    # The image benchmark's model: 8 layers of 256, up to 64 tokens an image.
    "small": VisionShape(ModelShape(256, 8, 768, 4, 2, 4096), (8, 12, 12), depth=4, embed_dim=128, num_heads=4,
                         max_pixels=28 * 28 * 64),
}


def make_tiny_vision_model(path: str | Path, *, shape: str = "tiny", model_type: str = "qwen2_vl",
                           seed: int = 0) -> Path:
    """Write a random-weight qwen2_vl (or qwen2_5_vl) model, its language model, vision tower and
    image processor config, to `path` and return it."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if shape not in VISION_SHAPES:
        raise ValueError(f"vision shape {shape!r}: choose from {', '.join(VISION_SHAPES)}")
    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    dims = VISION_SHAPES[shape]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(dims.text.vocab_size, VISION_SPECIAL_TOKENS, VISION_CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(out))
    token = tokenizer.convert_tokens_to_ids
    config = {
        "model_type": model_type,
        "architectures": [{"qwen2_vl": "Qwen2VLForConditionalGeneration",
                           "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[model_type]],
        "hidden_size": dims.text.hidden_size,
        "num_hidden_layers": dims.text.num_hidden_layers,
        "intermediate_size": dims.text.intermediate_size,
        "num_attention_heads": dims.text.num_attention_heads,
        "num_key_value_heads": dims.text.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": dims.text.vocab_size,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(dims.mrope_section)},
        "tie_word_embeddings": True,
        "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"),
        "vision_start_token_id": token("<|vision_start|>"),
        "vision_end_token_id": token("<|vision_end|>"),
        "bos_token_id": token("<|endoftext|>"),
        "eos_token_id": token(EOS_TOKEN),
        "torch_dtype": "float32",
        "vision_config": _vision_config(model_type, dims),
    }
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": dims.min_pixels, "max_pixels": dims.max_pixels,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }
    mx.random.seed(seed)
    model_config = family.ModelConfig.from_dict(dict(config))
    model_config.text_config = family.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = family.VisionConfig.from_dict(model_config.vision_config)
    model = family.Model(model_config)
    # Doubled, a random language model's matrices give varied tokens; at their initial scale a few
    # layers settle on one token whatever the prompt.
    weights = {k: (v * 2 if k.startswith("language_model.") and v.ndim == 2 else v)
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out


def _vision_config(model_type: str, dims: VisionShape) -> dict[str, object]:
    """The vision tower's config: Qwen2-VL names its width embed_dim and sizes its MLP by ratio;
    Qwen2.5-VL names them hidden_size and intermediate_size and attends in windows."""
    common = {"model_type": model_type, "depth": dims.depth, "num_heads": dims.num_heads, "patch_size": 14,
              "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    if model_type == "qwen2_vl":
        return {**common, "embed_dim": dims.embed_dim, "hidden_size": dims.text.hidden_size, "mlp_ratio": 2}
    return {**common, "hidden_size": dims.embed_dim, "intermediate_size": 2 * dims.embed_dim,
            "out_hidden_size": dims.text.hidden_size, "window_size": 56, "fullatt_block_indexes": [dims.depth - 1]}


def make_tiny_adapter(
    path: str | Path, model: object, *, keys: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj"),
    rank: int = 4, scale: float = 10.0, num_layers: int = -1, seed: int = 0, strength: float = 0.05,
) -> Path:
    """Write a random LoRA adapter for `model` (an mlx-lm model) to `path`, as `mlx_lm.lora` lays
    one out: adapter_config.json and adapters.safetensors with `lora_a` / `lora_b` for the layers
    named by `keys` in the last `num_layers` blocks (-1: all). B is not zero (as after training),
    so the adapter changes the model's output; `strength` is the spread of its entries."""
    import json

    import mlx.core as mx

    layers = list(model.layers)  # type: ignore[attr-defined]
    count = len(layers) if num_layers < 0 else num_layers
    prefix = next(name for name, module in model.named_modules()  # type: ignore[attr-defined]
                  if module is layers[0]).rsplit(".", 1)[0]
    key = mx.random.key(seed)
    tensors = {}
    for index in range(len(layers) - count, len(layers)):
        modules = dict(layers[index].named_modules())
        for name in keys:
            outputs, inputs = modules[name].weight.shape
            key, a_key, b_key = mx.random.split(key, 3)
            bound = 1 / inputs ** 0.5
            tensors[f"{prefix}.{index}.{name}.lora_a"] = mx.random.uniform(-bound, bound, (inputs, rank), key=a_key)
            tensors[f"{prefix}.{index}.{name}.lora_b"] = strength * mx.random.normal((rank, outputs), key=b_key)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), tensors)
    config = {"fine_tune_type": "lora", "num_layers": count,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
