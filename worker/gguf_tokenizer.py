"""A GGUF file's tokenizer as a Hugging Face fast tokenizer (what mlx-lm's TokenizerWrapper loads).

The metadata holds a byte-level BPE tokenizer (`tokenizer.ggml.model` = gpt2): the tokens, the
merges, each token's type (3 = control: the special tokens), the bos/eos/unk/pad ids and the chat
template. `tokenizer.ggml.pre` names the pre-tokenizer llama.cpp applies before the byte-level
split; the ones mapped here are PRE_TOKENIZERS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

CONTROL_TOKEN = 3  # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
USER_DEFINED_TOKEN = 4


def _byte_level() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# `tokenizer.ggml.pre` -> the Hugging Face pre-tokenizer that splits text the same way.
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "default": _byte_level,
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
}


def save_tokenizer(metadata: dict[str, Any], into: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and the special tokens
    map of the GGUF metadata's tokenizer into `into`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from worker.gguf import GGUFError

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {kind!r}: mlxq rebuilds byte-level BPE (gpt2) tokenizers only; "
                        "convert the original Hugging Face model with `mlx_lm.convert` and serve that directory")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre {pre!r}: not a pre-tokenizer mlxq maps ({', '.join(PRE_TOKENIZERS)}); "
                        "convert the original Hugging Face model with `mlx_lm.convert` and serve that directory")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    types = metadata.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(tokens, types) if kind == USER_DEFINED_TOKEN])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, types) if kind == CONTROL_TOKEN])

    def token(name: str) -> Any:
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(value.item())] if value is not None else None

    bos = token("bos")
    if bos is not None and _flag(metadata, "add_bos_token"):  # llama.cpp prepends it to every text
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(into))


def _flag(metadata: dict[str, Any], name: str) -> bool:
    value = metadata.get(f"tokenizer.ggml.{name}")
    return bool(value.item()) if value is not None else False
