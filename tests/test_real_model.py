"""The engine suites on the real model, where the words must make sense: SmolLM2-135M-Instruct from
its Q4_1 GGUF file (the `real_model` fixture), loaded by the worker's own code (worker/loading.py:
converted, then upcast and dequantized as a CPU worker serves it) and run through the worker's own
engine choice (`engine_for_model`) and `BatchScheduler`, in this process, as the parity suites run
the tiny random models.

The reference is mlx-lm alone: the converted directory loaded by mlx-lm, its scales cast to float32
and its layers dequantized by mlx-lm's own `dequantize_model`, each request decoded alone through
`generate_step`; logprobs are also checked against mlx-lm's forward pass on the checkpoint's own
4-bit layers. Kept short (a few real questions, a dozen tokens each, one batch per engine), since
the model decodes a few tokens a second per row on a 2-core CPU. Images stay on the tiny vision
model (test_vision_engine.py, test_images.py and the rest): this model is text-only and refuses them.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)

from tests.reference import greedy_alone, run_all, teacher_forced_logprobs
from worker.scheduler import BatchScheduler

pytestmark = pytest.mark.slow

ENGINES = ("batch-generator", "compiled")
MAX_TOKENS = 12
# A question, and a word its greedy answer must contain (what this model answers, and right).
QUESTIONS = {
    "france": ("What is the capital of France?", "Paris"),
    "japan": ("What is the capital of Japan?", "Tokyo"),
    "sum": ("What is 2 + 2?", "4"),
    "ocean": ("What is the largest ocean on Earth?", "Pacific"),
    "romeo": ("Who wrote Romeo and Juliet?", "Shakespeare"),
}
FIRST_WAVE = ("france", "japan", "sum")  # the rest join while these decode
JOIN_AFTER_STEPS = 3
SEEDED = {"messages": [{"role": "user", "content": "Write a sentence about the sea."}], "max_tokens": 10,
          "temperature": 0.8, "top_p": 0.95, "seed": 1234, "n": 2, "logprobs": True, "return_prompt_token_ids": True}
RAW = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": True,
       "top_logprobs": 3, "return_prompt_token_ids": True}


def chat(question: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": True, "return_prompt_token_ids": True, **fields}


# --- the model as a worker serves it, and mlx-lm's reference --------------------------------------
@pytest.fixture(scope="module")
def served(real_model: str) -> tuple[Any, Any]:
    """(model, tokenizer) loaded as `mlxq worker --model <the GGUF file>` loads them."""
    from worker.loading import load_model
    from worker.settings import WorkerSettings

    return load_model(WorkerSettings(model=real_model))


@pytest.fixture(scope="module")
def mlx_lm_models(real_model: str) -> tuple[Any, Any]:
    """mlx-lm's own load of the converted directory in float32: (the 4-bit model as shipped, with
    float32 scales; the same dequantized by mlx-lm)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    from worker.loading import model_directory

    quantized, _ = load(model_directory(real_model))
    quantized.set_dtype(mx.float32)
    dense, _ = load(model_directory(real_model))
    dense.set_dtype(mx.float32)
    return quantized, dequantize_model(dense)


class Alone:
    """mlx-lm's greedy decoding of one request alone (the dequantized float32 reference), each
    prompt computed once for the module."""

    def __init__(self, model: Any, eos: set[int]) -> None:
        self.model = model
        self.eos = eos
        self._done: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._done:
            self._done[key] = greedy_alone(self.model, prompt_ids, max_tokens, self.eos)
        return self._done[key]


@pytest.fixture(scope="module")
def alone(mlx_lm_models, served) -> Alone:
    return Alone(mlx_lm_models[1], set(served[1].eos_token_ids))


def make_scheduler(served: tuple[Any, Any], decode: str, max_num_seqs: int = 8,
                   prefix_cache_mb: int = 0) -> BatchScheduler:
    """The engine `mlxq worker --decode <decode>` builds for this model (kernels built at first use)."""
    from worker.loading import engine_for_model
    from worker.settings import WorkerSettings

    settings = WorkerSettings(decode=decode, decode_warmup="off", max_num_seqs=max_num_seqs,
                              prefix_cache_mb=prefix_cache_mb)
    model, tokenizer = served
    return BatchScheduler(engine_for_model(settings, model, tokenizer), max_num_seqs=max_num_seqs)


def run_with_joiners(scheduler: BatchScheduler, first: dict[str, dict], joining: dict[str, dict],
                     join_after: int) -> dict[str, Any]:
    """Admit `first`, step `join_after` times, admit `joining` while they decode, run to the end."""
    results: dict[str, Any] = {}

    def admit(requests: dict[str, dict]) -> None:
        for job_id, request in requests.items():
            failed = scheduler.admit(job_id, request)
            if failed is not None:
                results[job_id] = failed

    admit(first)
    for _ in range(join_after):
        results.update((ended.id, ended.result()) for ended in scheduler.step())
    assert len(scheduler) >= len(first) - 1, "the first wave ended before the joiners came"
    admit(joining)
    results.update(run_all(scheduler, {}))
    return results


# --- one batch per engine: greedy questions, joiners, a prefix shared, n seeded choices, a raw prompt
class Batch:
    def __init__(self, decode: str, scheduler: BatchScheduler, requests: dict[str, dict],
                 results: dict[str, Any]) -> None:
        self.decode = decode
        self.scheduler = scheduler
        self.requests = requests
        self.results = results
        self.prefix_cache = scheduler.engine.prefix_cache_stats()


@pytest.fixture(scope="module", params=ENGINES)
def batch(request, served) -> Batch:
    scheduler = make_scheduler(served, request.param, prefix_cache_mb=64)
    questions = {name: chat(question) for name, (question, _) in QUESTIONS.items()}
    first = {name: questions[name] for name in FIRST_WAVE}
    joining = {**{name: q for name, q in questions.items() if name not in first}, "seeded": SEEDED, "raw": RAW}
    results = run_with_joiners(scheduler, first, joining, JOIN_AFTER_STEPS)
    return Batch(request.param, scheduler, {**first, **joining}, results)


def test_greedy_answers_are_right_and_what_mlx_lm_gives_each_alone(batch: Batch, alone: Alone, served) -> None:
    messages = batch.requests["france"]["messages"]
    assert batch.results["france"].prompt_token_ids == served[1].apply_chat_template(messages,
                                                                                     add_generation_prompt=True)
    for name, (question, word) in QUESTIONS.items():
        result = batch.results[name]
        assert result.status == "finished", result.error
        choice = result.choices[0]
        assert word in choice.text, (question, choice.text)
        tokens, logprobs = alone(result.prompt_token_ids, MAX_TOKENS)
        assert choice.token_ids == tokens, (name, choice.text)
        assert choice.logprobs == pytest.approx(logprobs, abs=1e-3), name
        assert choice.finish_reason == ("stop" if tokens[-1] in alone.eos else "length")


def test_joiners_reused_the_chat_templates_shared_prefix(batch: Batch) -> None:
    """Every chat here starts with the template's system prompt: the joiners found it cached."""
    assert batch.prefix_cache["hits"] >= 1 and batch.prefix_cache["reused_tokens"] >= 16, batch.prefix_cache


def test_seeded_n_choices_are_what_the_request_gives_alone(batch: Batch, served, mlx_lm_models) -> None:
    joined = batch.results["seeded"]
    assert joined.status == "finished" and len(joined.choices) == 2
    assert joined.choices[0].token_ids != joined.choices[1].token_ids  # two draws, not one
    by_itself = run_all(make_scheduler(served, batch.decode), {"seeded": SEEDED})["seeded"]
    for got, want in zip(joined.choices, by_itself.choices):
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.text.strip()
    # the raw logprobs are mlx-lm's log-softmax at each sampled position
    for choice in joined.choices:
        reference = teacher_forced_logprobs(mlx_lm_models[1], joined.prompt_token_ids, choice.token_ids)
        assert choice.logprobs == pytest.approx([reference[j][t] for j, t in enumerate(choice.token_ids)], abs=1e-3)


def test_logprobs_match_mlx_lms_forward_pass_on_the_4bit_layers(batch: Batch, mlx_lm_models) -> None:
    """The served model is dequantized; its logprobs and top_logprobs are those of mlx-lm's forward
    pass through the checkpoint's quantized layers (float32 scales), within 1e-3."""
    raw = batch.results["raw"]
    choice = raw.choices[0]
    assert "Paris" in choice.text
    assert raw.prompt_token_ids == list(batch.scheduler.engine.tokenizer.encode(RAW["prompt"]))
    reference = teacher_forced_logprobs(mlx_lm_models[0], raw.prompt_token_ids, choice.token_ids)
    assert choice.token_ids == [int(np.argmax(row)) for row in reference]
    assert choice.logprobs == pytest.approx([reference[j][t] for j, t in enumerate(choice.token_ids)], abs=1e-3)
    for j, top in enumerate(choice.top_logprobs):
        assert [t.token_id for t in top] == np.argsort(-reference[j])[:3].tolist()
        assert [t.logprob for t in top] == pytest.approx(np.sort(reference[j])[::-1][:3].tolist(), abs=1e-3)


def test_an_image_is_refused_by_the_text_model(batch: Batch) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    failed = batch.scheduler.admit("image", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, image]}]})
    assert failed is not None and "messages[0].content" in failed.error.message


# --- stop strings and structured output on real text ---------------------------------------------
def test_stop_strings_cut_the_real_answer(served, alone: Alone) -> None:
    plain = chat(QUESTIONS["france"][0])
    requests = {"straddling": {**plain, "stop": ["France is P"]},  # " is" and " Paris" are two tokens
                "period": {**plain, "stop": ["never", "."]}}
    results = run_all(make_scheduler(served, "compiled"), requests)
    full_ids, _ = alone(results["period"].prompt_token_ids, MAX_TOKENS)
    assert served[1].decode(full_ids, skip_special_tokens=True) == "The capital of France is Paris."
    for name, text in (("straddling", "The capital of "), ("period", "The capital of France is Paris")):
        choice = results[name].choices[0]
        assert (choice.text, choice.finish_reason) == (text, "stop"), name
        assert choice.token_ids == full_ids[: len(choice.token_ids)]  # through the token that completed it
        assert choice.stop_sequence == requests[name]["stop"][-1]


CAPITAL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "country": {"type": "string", "maxLength": 20}},
           "required": ["city", "country"], "additionalProperties": False}
SUM = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
       "additionalProperties": False}


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("decode", ENGINES)
def test_json_schema_answers_are_valid_and_right_beside_a_free_row(served, alone: Alone, decode: str) -> None:
    scheduler = make_scheduler(served, decode)
    requests = {
        "capital": chat("What is the capital of France? Reply in JSON with the city and its country.",
                        max_tokens=32, response_format=json_format(CAPITAL)),
        "sum": chat("What is 2 + 2? Reply in JSON.", max_tokens=16, response_format=json_format(SUM)),
        "free": chat(QUESTIONS["france"][0]),
    }
    results = run_all(scheduler, requests)
    documents: dict[str, Any] = {}
    for name in ("capital", "sum"):
        choice = results[name].choices[0]
        assert choice.finish_reason == "stop" and choice.constraint_complete, (name, choice.text)
        documents[name] = json.loads(choice.text)
    jsonschema.validate(documents["capital"], CAPITAL)
    assert documents["capital"]["city"] == "Paris" and documents["capital"]["country"].lower() == "france", documents
    assert documents["sum"] == {"answer": 4}
    free = results["free"].choices[0]
    assert free.token_ids == alone(results["free"].prompt_token_ids, MAX_TOKENS)[0]  # untouched by the masks



# --- a worker process serving the GGUF file --------------------------------------------------------
def test_a_worker_process_serves_the_gguf_file_as_mlx_lm_answers(redis_url: str, real_model: str, alone: Alone
                                                                  ) -> None:
    """`mlxq worker --model <file>.gguf`, its model named by the file's stem: greedy questions and
    a JSON-schema request together through the producer, each what mlx-lm gives it alone."""
    from producer import Client
    from tests.workers import start_worker, stop

    proc = start_worker(redis_url, real_model, "--max-num-seqs", "8", name="real",
                        env={"MLXQ_DECODE_WARMUP": "off"})  # no kernel build beside the other tests
    client = Client(redis_url)
    out = ""
    try:
        model = "SmolLM2-135M-Instruct.Q4_1"
        questions = {name: chat(question, model=model) for name, (question, _) in QUESTIONS.items()}
        capital = chat("What is the capital of France? Reply in JSON with the city and its country.",
                       max_tokens=32, response_format=json_format(CAPITAL), model=model)
        ids = client.submit_many([*questions.values(), capital])
        results = client.wait_many(ids, timeout=300)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "float16 tensors upcast to float32" in out and "layers dequantized" in out, out[-3000:]
    for job_id, (name, (_, word)) in zip(ids, QUESTIONS.items()):
        result = results[job_id]
        assert result.status == "finished", (result.error, out[-3000:])
        assert word in result.choices[0].text
        tokens, logprobs = alone(result.prompt_token_ids, MAX_TOKENS)
        assert result.choices[0].token_ids == tokens, name
        assert result.choices[0].logprobs == pytest.approx(logprobs, abs=1e-3), name
    document = json.loads(results[ids[-1]].choices[0].text)
    jsonschema.validate(document, CAPITAL)
    assert document["city"] == "Paris"
