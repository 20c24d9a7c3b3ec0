"""The frameworks people point at an OpenAI-compatible server, from their PyPI packages, offline, against
`mlxq api` and a real worker on the tiny random-weight model: LangChain's ChatOpenAI (bind_tools,
with_structured_output) and lm-evaluation-harness (`local-completions` and `local-chat-completions`, a
log-likelihood multiple-choice task and a generate_until task defined here over local JSONL files),
whose scores must equal an in-process computation with mlx-lm on the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis

from mlxq.redis_server import RedisServer
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_worker, stop

pytestmark = pytest.mark.slow  # a worker process and the gateway

KEY = "sk-frameworks-test"


@dataclass
class Stack:
    base: str  # .../v1
    model_dir: str


@pytest.fixture(scope="module")
def stack(tiny_model_dir: str) -> Iterator[Stack]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        proc = start_worker(server.url, tiny_model_dir, "--alias", "tiny", "--max-num-seqs", "8", name="frameworks")
        try:
            wait_live(conn, "frameworks", timeout=180)
            with running_gateway(server.url, api_keys=key_entry("acme", KEY)) as base:
                yield Stack(base, tiny_model_dir)
        finally:
            print(stop(proc)[-3000:])
            conn.close()


# ---------------------------------------------------------------- LangChain

def _chat(stack: Stack, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny", base_url=stack.base, api_key=KEY, max_retries=0, timeout=120, **kwargs)


def test_langchain_bind_tools_blocking_and_streamed(stack: Stack) -> None:
    from pydantic import BaseModel, Field

    class Multiply(BaseModel):
        """Multiply two integers."""

        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(pattern="^[A-Za-z]{1,8}$")

    # strict: OpenAI's closed schemas (no properties beyond those named), which a random model needs: an
    # open schema lets it add keys until max_tokens.
    llm = _chat(stack, max_tokens=128, seed=1)
    named = llm.bind_tools([Multiply, GetWeather], tool_choice="Multiply", parallel_tool_calls=False, strict=True)
    message = named.invoke("What is 6 times 7?")
    (call,) = message.tool_calls
    assert call["name"] == "Multiply" and call["id"].startswith("call_")
    Multiply(**call["args"])
    required = llm.bind_tools([Multiply, GetWeather], tool_choice="required", parallel_tool_calls=False, strict=True)
    chunks = list(required.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    (streamed,) = merged.tool_calls
    {"Multiply": Multiply, "GetWeather": GetWeather}[streamed["name"]](**streamed["args"])
    blocking = required.invoke("What is the weather in Paris?").tool_calls
    assert [(c["name"], c["args"]) for c in blocking] == [(streamed["name"], streamed["args"])]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(stack: Stack, method: str) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(pattern="^[A-Za-z]{1,10}$")
        population: int = Field(ge=0, le=10_000_000)

    structured = _chat(stack, max_tokens=96, seed=2).with_structured_output(City, method=method, strict=True)
    city = structured.invoke("Name a large city.")
    assert isinstance(city, City)
    jsonschema.validate(city.model_dump(), City.model_json_schema())


# ---------------------------------------------------------------- lm-evaluation-harness

# One process for every run (the harness takes seconds to import); only the tasks defined here are indexed.
_HARNESS = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
include, out, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tasks = TaskManager(include_path=include, include_defaults=False)
done = []
for run in runs:
    results = simple_evaluate(model=run["model"], model_args=run["model_args"], tasks=run["tasks"], task_manager=tasks,
                              log_samples=True, apply_chat_template=run["chat"], batch_size=1)
    done.append({"results": results["results"], "samples": results["samples"]})
json.dump(done, open(out, "w"), default=str)
"""

MC_DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "red car", "blue sky"]},
    {"question": "A message queue carries jobs from", "choices": ["web servers", "the sea", "numbers"]},
    {"question": "Redis keeps the queue, the results and", "choices": ["the streams", "a poem", "the fox"]},
    {"question": "Hello world! How are", "choices": ["you today", "tokens sampled", "dogs"]},
]
GEN_PROMPTS = ["The quick brown fox", "Redis keeps the queue", "Write a short poem", "Numbers 0 1 2"]


def _loglikelihood(model: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """lm-eval's split (trailing spaces move to the continuation; the whole encoded, the context's
    tokens cut off) and the continuation's summed logprob, from one forward pass."""
    import mlx.core as mx

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    logits = model(mx.array(whole)[None])[0].astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return float(sum(rows[i - 1, whole[i]].item() for i in range(start, len(whole))))


def _greedy(model: Any, tokenizer: Any, prompt_ids: list[int], max_tokens: int, until: str) -> str:
    from tests.reference import greedy_alone  # mlx-lm's own loop, the request alone

    eos = {tokenizer.convert_tokens_to_ids(tokenizer.eos_token)}
    tokens, _ = greedy_alone(model, prompt_ids, max_tokens, eos)
    text = tokenizer.decode([t for t in tokens if t not in eos])
    return text.split(until)[0]


def _write_tasks(folder: Path, mc: list[dict], gen: list[dict], chat_gen: list[dict]) -> None:
    for name, rows in (("mc", mc), ("gen", gen), ("chatgen", chat_gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: mlxq_mc\n" + common.format(path=folder / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
        "metric_list:\n  - metric: acc\n")
    for task, data in (("mlxq_gen", "gen"), ("mlxq_chatgen", "chatgen")):
        (folder / f"{data}.yaml").write_text(
            f"task: {task}\n" + common.format(path=folder / f"{data}.jsonl") + "output_type: generate_until\n"
            'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
            "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n")


def _harness(runs: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    out = folder / "harness.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": KEY,
           "HF_DATASETS_CACHE": str(folder / "hf-cache"), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", _HARNESS, str(folder), str(out), json.dumps(runs)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return list(json.loads(out.read_text()))


def test_lm_eval_harness_scores_equal_an_in_process_computation(stack: Stack, tmp_path: Path) -> None:
    import worker  # noqa: F401
    from mlx_lm import load
    from transformers import AutoTokenizer

    model, _ = load(stack.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    # Gold answers and targets made from the model's own scores: right for the first half, wrong for the rest,
    # so each metric has a value only a faithful server gives (0.5).
    mc, expected_ll = [], []
    for i, doc in enumerate(MC_DOCS):
        lls = [_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        best = max(range(len(lls)), key=lls.__getitem__)
        mc.append({**doc, "gold": best if i < 2 else (best + 1) % len(lls)})
        expected_ll.append(lls)
    gen, chat_gen = [], []
    for i, prompt in enumerate(GEN_PROMPTS):
        plain = _greedy(model, tokenizer, tokenizer(prompt, add_special_tokens=False).input_ids, 8, "\n")
        templated = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=False)
        chatted = _greedy(model, tokenizer, tokenizer(templated, add_special_tokens=False).input_ids, 8, "\n")
        gen.append({"prompt": prompt, "target": plain if i < 2 else plain + " nope"})
        chat_gen.append({"prompt": prompt, "target": chatted if i < 2 else chatted + " nope"})
    _write_tasks(tmp_path, mc, gen, chat_gen)

    completions, chat = _harness([
        {"model": "local-completions", "tasks": ["mlxq_mc", "mlxq_gen"], "chat": False, "model_args": {
            "model": "tiny", "base_url": f"{stack.base}/completions", "tokenizer": stack.model_dir,
            "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1}},
        {"model": "local-chat-completions", "tasks": ["mlxq_chatgen"], "chat": True, "model_args": {
            "model": "tiny", "base_url": f"{stack.base}/chat/completions", "num_concurrent": 1, "max_retries": 1}},
    ], tmp_path)
    assert completions["results"]["mlxq_mc"]["acc,none"] == 0.5
    got_ll = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in completions["samples"]["mlxq_mc"]}
    for doc_id, lls in enumerate(expected_ll):
        assert got_ll[doc_id] == pytest.approx(lls, abs=1e-3)
    assert completions["results"]["mlxq_gen"]["exact_match,none"] == 0.5
    assert chat["results"]["mlxq_chatgen"]["exact_match,none"] == 0.5
