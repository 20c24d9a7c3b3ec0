"""`mlxq demo`: Redis, a model, a worker process and concurrent producers on one machine.

The model is the real SmolLM2-135M-Instruct (`mlxq real-model`) unless `--tiny` (a random-weight
model: gibberish, but it starts in a second) or `--vision` (image jobs, with pictures drawn here,
on a tiny vision-language model) says otherwise.

Everything it starts it stops: the private redis-server, the worker, the temporary model dir.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Iterator, Optional

from tqdm import tqdm

from mlxq.redis_server import existing_or_private

PROMPTS = [
    "Explain continuous batching in one sentence.",
    "Write a haiku about message queues.",
    "List three uses of Redis.",
    "What is a token?",
    "Hello world!",
    "Summarize: the quick brown fox jumps over the lazy dog.",
]
# Chats for the real model; the first is also the one timed from the worker's start.
QUESTIONS = [  # odd ones are asked greedily, and shown at the end
    "Write a haiku about message queues.",
    "What is the capital of France?",
    "Give me a synonym for the word fast.",
    "Who wrote Romeo and Juliet?",
    "Tell me a fun fact about cats.",
    "Explain what a CPU does in one sentence.",
    "Suggest a name for a pet goldfish.",
    "Name the three primary colors.",
]


def _real_model() -> Optional[str]:
    """The packaged real model's GGUF file, or None (with a note) when its package is missing."""
    from mlxq.real_model import RealModelMissing, put_in_place

    try:
        return str(put_in_place())
    except RealModelMissing as exc:
        print(f"{exc}; running the tiny random-weight model instead", file=sys.stderr)
        return None


@contextlib.contextmanager
def _model(model: Optional[str], vision: bool = False) -> Iterator[str]:
    if model:
        yield model
        return
    workdir = tempfile.mkdtemp(prefix="mlxq-demo-")
    try:
        subprocess.run([sys.executable, "-m", "mlxq", "make-tiny-model", *(["--vision"] if vision else []),
                        f"{workdir}/tiny"], check=True, stdout=subprocess.DEVNULL)
        kind = "vision-language model (qwen2_vl)" if vision else "model"
        print(f"built the tiny random-weight {kind} in {workdir}/tiny (its text is gibberish by design)")
        yield f"{workdir}/tiny"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def image_request(i: int, max_tokens: int) -> dict:
    """Job i of `mlxq demo --vision`: a picture drawn here (every third job has two, every fourth
    none), a question, and greedy or seeded sampling with logprobs."""
    pictures = [] if i % 4 == 3 else [_picture(i)] + ([_picture(i + 100)] if i % 3 == 0 else [])
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in pictures]
    question = ["What is in this picture?", "Describe the colours.", "Count the shapes.", "Tell a joke."][i % 4]
    return {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": question}]}],
            "max_tokens": max_tokens, "temperature": 0.0 if i % 2 else 0.8, "seed": i, "logprobs": True,
            "custom_id": f"demo-{i}"}


def _picture(i: int) -> str:
    """A data URL of a small generated picture: a gradient with a few shapes, PNG or JPEG."""
    import base64
    import io

    from PIL import Image, ImageDraw

    width, height = 96 + 24 * (i % 3), 72 + 16 * (i % 2)
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for k in range(1 + i % 3):
        x, y = (17 * (i + k)) % width, (29 * (i + 2 * k)) % height
        draw.ellipse((x, y, x + 20, y + 20), fill=((60 * i) % 256, (90 * k) % 256, 200))
    fmt = "JPEG" if i % 2 else "PNG"
    out = io.BytesIO()
    image.save(out, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


@contextlib.contextmanager
def worker_process(url: str, model: str, *args: str, name: str = "demo", log_level: str = "WARNING",
                   log: Optional[IO[bytes]] = None) -> Iterator[subprocess.Popen[bytes]]:
    """An `mlxq worker` on `model` while the block runs (`args`: more of its flags; `log`: where its
    output goes, else this process's). The demo's, and examples/grpo's."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxq", "worker", "--model", model, *args, "--name", f"{name}-{os.getpid()}",
         "--log-level", log_level],
        env={**os.environ, "MLXQ_REDIS_URL": url},  # not argv: a password there shows in `ps`
        stdout=log, stderr=subprocess.STDOUT if log is not None else None,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chat_request(i: int, max_tokens: int) -> dict:
    """Job i on the real model: a question; odd jobs greedy, even ones sampled with a seed."""
    return {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "max_tokens": max_tokens,
            "temperature": 0.0 if i % 2 else 0.7, "seed": i, "custom_id": f"demo-{i}"}


def run_demo(
    url: Optional[str] = None,
    model: Optional[str] = None,
    jobs: int = 48,
    threads: int = 4,
    max_tokens: Optional[int] = None,
    max_num_seqs: int = 32,
    vision: bool = False,
    tiny: bool = False,
) -> int:
    from producer import Client

    real = not (model or vision or tiny)
    model = model or (_real_model() if real else None)
    real = real and model is not None
    max_tokens = max_tokens or (48 if real else 32)
    with existing_or_private(url, announce=True) as redis_url, _model(model, vision) as model_path:
        client = Client(redis_url)
        # Submitted before the worker starts: timed from its start to the answer.
        first_request = (chat_request(1, max_tokens) if real
                         else {"prompt": "warm up", "max_tokens": 2, "custom_id": "warm-up"})
        first_id = client.submit({**first_request, "custom_id": "first"})
        started = time.perf_counter()
        with worker_process(redis_url, model_path, "--max-num-seqs", str(max_num_seqs)):
            first = client.wait(first_id, timeout=300)
            first_s = time.perf_counter() - started
            if real:
                print(f"first answer {first_s:.1f} s after the worker started: "
                      f"{QUESTIONS[1]!r} -> {_text(first)!r}")
            code = _run_jobs(client, jobs, threads, max_tokens, real, vision)
        client.close()
        return code


def _text(result: Any) -> str:
    return (result.choices[0].text if result.choices else result.error or "").strip()


def _run_jobs(client: Any, jobs: int, threads: int, max_tokens: int, real: bool, vision: bool) -> int:
    if real:
        requests = [chat_request(i, max_tokens) for i in range(jobs)]
    elif vision:
        requests = [image_request(i, max_tokens) for i in range(jobs)]
    else:
        requests = [
            {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0.0 if i % 2 else 0.8,
             "seed": i, "custom_id": f"demo-{i}"}
            for i in range(jobs)
        ]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool, \
            tqdm(total=jobs, desc="jobs done", unit="job", file=sys.stderr, disable=None, leave=False) as bar:
        ids = list(pool.map(client.submit, requests))

        def wait(job_id: str) -> Any:
            result = client.wait(job_id, timeout=600)
            bar.update()
            return result

        results = list(pool.map(wait, ids))
    elapsed = time.perf_counter() - start

    print(f"\n{'custom_id':<10} {'status':<9} {'finish':<7} {'prompt':>6} {'compl':>6}  text")
    for result in results:
        choice = result.choices[0] if result.choices else None
        text = (choice.text if choice else "").replace("\n", " ")[:48]
        print(f"{result.custom_id or '':<10} {result.status:<9} {(choice.finish_reason if choice else '') or '':<7} "
              f"{result.usage.prompt_tokens:>6} {result.usage.completion_tokens:>6}  {text!r}")
    completion = sum(r.usage.completion_tokens for r in results)
    failed = sum(r.status != "finished" for r in results)
    ttfts = sorted(r.timings.ttft_s for r in results if r.timings.ttft_s is not None)
    print(
        f"\n{jobs} jobs from {threads} threads in {elapsed:.2f} s: {jobs / elapsed:.1f} jobs/s, "
        f"{completion / elapsed:.1f} generated tokens/s, {failed} failed"
        + (f", median TTFT {ttfts[len(ttfts) // 2] * 1000:.0f} ms" if ttfts else "")
    )
    print(f"first token ids of {results[0].id}: {results[0].choices[0].token_ids[:8]}")
    if vision:
        first = results[0].choices[0]
        print(f"logprobs of its first tokens: {[round(lp, 3) for lp in (first.logprobs or [])[:4]]}; "
              "prompt tokens count each picture's image tokens")
    if real:
        print("\nsome answers (greedy):")
        for i in range(1, min(jobs, 2 * len(QUESTIONS)), 2)[:4]:
            print(f"  Q: {QUESTIONS[i % len(QUESTIONS)]}\n  A: {_text(results[i])}")
    return 1 if failed else 0
