"""GGUF files: the types MLX reads load as mlx-lm models equal to the model they were written
from (tensor names, Q/K row order, tokenizer, chat template); any other type is refused at
start-up, naming it; the packaged real model loads and answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import worker  # noqa: F401  (BLAS before MLX)
from schemas import keys
from tests.gguf_files import gguf_name, rotary_order, write_gguf, write_unreadable_gguf
from tests.workers import start_worker, stop
from worker.gguf import GGUFError, check_gguf, converted_directory, tensor_types
from worker.loading import ModelLoadError, check_model_setting
from worker.settings import WorkerSettings

CHAT = [{"role": "user", "content": "Hello world! 123 message queues"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


def _load(directory: Path):
    from mlx_lm import load

    return load(str(directory))


def test_a_float32_gguf_is_the_model_it_was_written_from(tiny_model_dir, tmp_path, cache):
    import mlx.core as mx

    path = write_gguf(Path(tiny_model_dir), tmp_path / "tiny.gguf", "F32")
    model, tokenizer = _load(converted_directory(path, cache))
    original, original_tokenizer = _load(Path(tiny_model_dir))
    tokens = mx.array([[5, 17, 99, 3, 250, 7, 42]])
    assert mx.array_equal(model(tokens), original(tokens))  # Q and K rows back in order, nothing else moved
    text = "Hello world! 123 message queues <|im_end|>"
    assert tokenizer.encode(text) == original_tokenizer.encode(text)
    assert tokenizer.decode(original_tokenizer.encode(text)) == text
    assert (tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
            == original_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    assert set(tokenizer.eos_token_ids) == set(original_tokenizer.eos_token_ids)


@pytest.mark.parametrize("kind, bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4), ("F16", None)])
def test_each_readable_type_loads_exactly_what_llama_cpp_wrote(tiny_model_dir, tmp_path, cache, kind, bits):
    """Each layer's weight, as the worker serves it (dequantized by MLX), equals what llama.cpp's
    own package reads back from the file's bytes, in the Hugging Face row order."""
    import mlx.core as mx
    import mlx.nn as nn
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = write_gguf(Path(tiny_model_dir), tmp_path / f"tiny-{kind}.gguf", kind)
    assert set(check_gguf(path).values()) == {kind, "F32"}
    model, _ = _load(converted_directory(path, cache))
    layers = dict(model.named_modules())
    reader = {t.name: t for t in GGUFReader(str(path)).tensors}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.0.mlp.down_proj",
                 "model.embed_tokens"):
        layer = layers[name]
        if bits is None:
            assert not isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            served = np.array(layer.weight.astype(mx.float32))
        else:
            assert layer.bits == bits and layer.group_size == 32
            scales, biases = layer.scales.astype(mx.float32), layer.biases.astype(mx.float32)  # as a CPU worker
            served = np.array(mx.dequantize(layer.weight, scales, biases, 32, bits))
        stored = reader[gguf_name(f"{name}.weight")]
        expected = dequantize(stored.data, stored.tensor_type).reshape(served.shape).astype(np.float32)
        if name.endswith(("q_proj", "k_proj")):  # the file holds rotary_order(weight): undo it to compare
            heads = served.shape[0] // 16  # head_dim 16
            expected = expected.reshape(heads, 8, 2, -1).swapaxes(1, 2).reshape(served.shape)
            assert np.array_equal(rotary_order(expected, heads), dequantize(stored.data, stored.tensor_type)
                                  .reshape(served.shape))
        np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6, err_msg=name)


def test_a_k_quant_is_refused_naming_its_type_and_the_way_to_convert(tmp_path):
    path = write_unreadable_gguf(tmp_path / "model.Q4_K_M.gguf", "Q4_K")
    assert tensor_types(path) == {"output_norm.weight": "F32", "blk.0.ffn_down.weight": "Q4_K"}
    with pytest.raises(GGUFError, match=r"tensor type Q4_K .*blk\.0\.ffn_down\.weight.*llama-quantize"):
        check_gguf(path)
    with pytest.raises(ModelLoadError, match=r"MLXQ_MODEL: model\.Q4_K_M\.gguf: tensor type Q4_K"):
        check_model_setting(str(path))
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        check_model_setting(str(tmp_path / "absent.gguf"))
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        check_model_setting(str(tmp_path / "text.gguf"))


def test_the_worker_refuses_an_unreadable_gguf_at_start_up(tmp_path):
    path = write_unreadable_gguf(tmp_path / "model.IQ2_XS.gguf", "IQ2_XS")
    done = subprocess.run([sys.executable, "-m", "mlxq", "worker", "--url", "redis://127.0.0.1:1/0", "--model",
                           str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "tensor type IQ2_XS" in done.stderr and "Q8_0" in done.stderr, done.stderr


def test_a_gguf_file_is_served_under_its_stem():
    settings = WorkerSettings(model="/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert settings.served_alias == keys.model_alias(settings.model) == "SmolLM2-135M-Instruct.Q4_1"
    assert settings.default_queues()[0] == "mlxq:SmolLM2-135M-Instruct.Q4_1"
    assert WorkerSettings(model="/m/x.gguf", alias="smol").served_alias == "smol"


def test_the_converted_directory_is_made_once_and_rebuilt_for_a_changed_file(tiny_model_dir, tmp_path):
    import os

    path = write_gguf(Path(tiny_model_dir), tmp_path / "tiny.gguf", "Q8_0")
    first = converted_directory(path, tmp_path / "cache")
    assert converted_directory(path, tmp_path / "cache") == first
    os.utime(path, ns=(1, 1))  # a changed file: another entry
    assert converted_directory(path, tmp_path / "cache") != first
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no half-written one left


def test_real_model_verb_prints_the_packaged_file(real_model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "mlxq", "real-model", "--dest", str(tmp_path), "--no-convert"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    copied = Path(done.stdout.strip())
    assert copied == tmp_path / Path(real_model).name and copied.stat().st_size == Path(real_model).stat().st_size


@pytest.mark.slow
def test_the_real_model_answers_through_a_worker(real_model, redis_url):
    """`mlxq worker --model <file>.gguf`, a request naming the file's stem: greedy, it knows Paris."""
    from producer import Client

    alias = Path(real_model).stem
    proc = start_worker(redis_url, real_model, "--max-num-seqs", "4")
    client = Client(redis_url)
    try:
        job = client.submit({"model": alias, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                             "max_tokens": 24, "temperature": 0})
        result = client.wait(job, timeout=300)
    finally:
        out = stop(proc)
        client.close()
    assert result.status == "finished", out
    assert "Paris" in result.choices[0].text, (result.choices[0].text, out)
    assert f"Listening on mlxq:{alias}" in out or f"mlxq:{alias}" in out, out
    assert "weights: 422 float16 tensors upcast to float32" in out and "211 quantized layers dequantized" in out, out


def test_the_real_models_tokenizer_comes_from_its_metadata(real_model):
    """SmolLM2's byte-level BPE with llama.cpp's `smollm` pre-tokenizer (digits one by one), its
    control tokens, its ChatML template with the default system prompt, and eos <|im_end|>."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(converted_directory(Path(real_model)))
    ids = tokenizer.encode("What is 12 times 345?")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p.strip() for p in pieces if p.strip().isdigit()] == list("12345"), pieces
    assert tokenizer.decode(ids) == "What is 12 times 345?"
    assert tokenizer.eos_token == "<|im_end|>" and set(tokenizer.eos_token_ids) == {2}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_start|>") == [1]  # a control token is one special token
