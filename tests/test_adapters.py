"""LoRA adapters per request on the compiled engine (worker/engines/lora.py): a request's output in a
batch mixing three adapters and the base model equals the same request run alone through mlx-lm with
its adapter fused into the weights; residency is least recently used first out under the memory cap;
an adapter the worker cannot serve fails its request naming `adapter`."""

from __future__ import annotations

import json

import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlx_lm import load

from tests.reference import fused_alone, greedy_alone, run_all
from worker.adapters import AdapterCatalog
from worker.engines.compiled import CompiledEngine
from worker.engines.text import TextEngine
from worker.scheduler import BatchScheduler
from worker.tiny_model import make_tiny_adapter

ALL_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Different layers, ranks, scales and depths, so the stacks pad ranks and hold zeros for layers an
# adapter leaves alone.
ADAPTERS = {
    "alpha": dict(keys=("self_attn.q_proj", "self_attn.v_proj"), rank=4, scale=10.0, seed=1, strength=0.3),
    "beta": dict(keys=ALL_LINEAR, rank=8, scale=2.0, num_layers=1, seed=2, strength=0.5),
    "team/gamma": dict(keys=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), rank=2, scale=20.0, seed=3,
                       strength=0.2),
}


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load(tiny_model_dir)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, model_and_tokenizer):
    root = tmp_path_factory.mktemp("adapters")
    for name, options in ADAPTERS.items():
        make_tiny_adapter(root / name, model_and_tokenizer[0], **options)
    return root


def prompt_ids(i: int, length: int) -> list[int]:
    return [(i * 37 + k * 11) % 500 + 3 for k in range(length)]


def test_mixed_batch_of_three_adapters_and_base_equals_each_alone_with_its_adapter_fused(
        tiny_model_dir, model_and_tokenizer, adapter_dir):
    model, tokenizer = model_and_tokenizer
    engine = CompiledEngine(model, tokenizer, max_num_seqs=12, prefix_cache_bytes=64 << 20,
                            adapters=AdapterCatalog(adapter_dir))
    scheduler = BatchScheduler(engine, max_num_seqs=12)
    names = [None, *ADAPTERS]
    requests = {}
    for i in range(10):  # every adapter and the base model twice or more, interleaved
        name = names[i % len(names)]
        body = {"prompt_token_ids": prompt_ids(i % 5, 6 + 3 * i), "max_tokens": 8 + i % 4, "temperature": 0,
                "logprobs": True, "ignore_eos": True}
        if name is not None:
            body["adapter"] = name
        requests[f"j{i}"] = body
    # n=2 under an adapter shares one prefill; a prompt under two adapters must not share KV.
    requests["n2"] = {"prompt_token_ids": prompt_ids(1, 20), "max_tokens": 6, "temperature": 0, "logprobs": True,
                      "ignore_eos": True, "n": 2, "adapter": "beta"}
    requests["same-prompt-base"] = {**requests["n2"], "n": 1}
    del requests["same-prompt-base"]["adapter"]
    results = run_all(scheduler, requests)
    differs = 0
    for job_id, body in requests.items():
        result = results[job_id]
        assert result.status == "finished", (job_id, result.error)
        base_tokens, _ = greedy_alone(model, body["prompt_token_ids"], body["max_tokens"], set())
        if body.get("adapter") is None:
            ref_tokens, ref_logprobs = greedy_alone(model, body["prompt_token_ids"], body["max_tokens"], set())
        else:
            ref_tokens, ref_logprobs = fused_alone(tiny_model_dir, adapter_dir / body["adapter"],
                                                   body["prompt_token_ids"], body["max_tokens"])
            differs += ref_tokens != base_tokens
        assert result.adapter == body.get("adapter")
        for choice in result.choices:
            assert choice.token_ids == ref_tokens, job_id
            assert choice.logprobs == pytest.approx(ref_logprobs, abs=1e-3), job_id
    assert differs >= 4  # the adapters do change the output
    stats = engine.stats().counters
    assert stats["adapters_resident"] == 3 and stats["adapter_loads"] == 3
    # The prefix cache now holds the base model's run of that prompt: a later request for it under an
    # adapter must not start from it.
    assert engine.prefix_cache_stats()["entries"] > 0
    later = run_all(scheduler, {"later": requests["n2"]})["later"]
    ref_tokens, _ = fused_alone(tiny_model_dir, adapter_dir / "beta", requests["n2"]["prompt_token_ids"], 6)
    assert [c.token_ids for c in later.choices] == [ref_tokens, ref_tokens]


def test_an_adapter_the_worker_does_not_have_fails_its_request_naming_adapter(model_and_tokenizer, adapter_dir,
                                                                               tmp_path):
    model, tokenizer = model_and_tokenizer
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora", "lora_parameters": {}}))
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, adapters=AdapterCatalog(tmp_path))
    scheduler = BatchScheduler(engine, max_num_seqs=4)
    body = {"prompt_token_ids": prompt_ids(0, 5), "max_tokens": 3, "temperature": 0}
    for adapter, says in (("missing", "no adapter 'missing'"), ("broken", "'dora' fine-tune"),
                          ("../adapters", "not an adapter name")):
        result = scheduler.admit("x", {**body, "adapter": adapter})
        assert result is not None and result.status == "failed"
        assert result.error.type == "InvalidRequest"
        assert result.error.message.startswith("adapter:") and says in result.error.message, result.error.message
    # Without MLXQ_ADAPTER_DIR the message says so, on either decode path.
    for engine in (CompiledEngine(model, tokenizer, max_num_seqs=4), TextEngine(model, tokenizer, max_num_seqs=4)):
        refused = BatchScheduler(engine, max_num_seqs=4).admit("y", {**body, "adapter": "alpha"})
        assert refused.status == "failed" and "adapter: this worker has no adapter 'alpha'" in refused.error.message
        assert "MLXQ_ADAPTER_DIR is not set" in refused.error.message


def test_the_batch_generator_path_groups_adapters_and_each_request_equals_alone_fused(
        tiny_model_dir, model_and_tokenizer, adapter_dir):
    """mlx-lm's BatchGenerator runs every row alike: jobs of one adapter (or of the base model)
    decode together, the next adapter's once the batch is empty; each equals its reference."""
    model, tokenizer = model_and_tokenizer
    engine = TextEngine(model, tokenizer, max_num_seqs=8, prefix_cache_bytes=64 << 20,
                        adapters=AdapterCatalog(adapter_dir))
    scheduler = BatchScheduler(engine, max_num_seqs=8)
    names = ["alpha", "alpha", None, "beta", None, "team/gamma", "alpha"]
    requests = {}
    for i, name in enumerate(names):
        body = {"prompt_token_ids": prompt_ids(i % 3, 5 + 4 * i), "max_tokens": 6 + i % 3, "temperature": 0,
                "logprobs": True, "ignore_eos": True}
        if name is not None:
            body["adapter"] = name
        requests[f"g{i}"] = body
    for job_id, body in requests.items():
        assert scheduler.admit(job_id, body) is None
    results, groups = {}, []
    while len(scheduler):
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        running = {job.request.adapter for job in scheduler._jobs.values() if job.in_engine}
        assert len(running) <= 1
        if running and (not groups or groups[-1] != running):
            groups.append(running)
    assert groups[:3] == [{"alpha"}, {None}, {"beta"}]  # in arrival order, one adapter at a time
    for job_id, body in requests.items():
        choice = results[job_id].choices[0]
        if body.get("adapter") is None:
            ref_tokens, ref_logprobs = greedy_alone(model, body["prompt_token_ids"], body["max_tokens"], set())
        else:
            ref_tokens, ref_logprobs = fused_alone(tiny_model_dir, adapter_dir / body["adapter"],
                                                   body["prompt_token_ids"], body["max_tokens"])
        assert choice.token_ids == ref_tokens, job_id
        assert choice.logprobs == pytest.approx(ref_logprobs, abs=1e-3), job_id


def test_residency_is_least_recently_used_first_out_under_the_cap_and_pinned_adapters_stay(
        model_and_tokenizer, adapter_dir):
    model, tokenizer = model_and_tokenizer
    catalog = AdapterCatalog(adapter_dir)
    probe = CompiledEngine(model, tokenizer, max_num_seqs=4, adapters=catalog)
    for name in ADAPTERS:
        probe.adapters.check(name)
    sizes = {r.weights.source.name: r.nbytes for r in probe.adapters._resident.values()}
    # Room for alpha and gamma together, not for beta beside either.
    cap = sizes["beta"]
    assert sizes["alpha"] + sizes["team/gamma"] <= cap < sizes["beta"] + min(sizes["alpha"], sizes["team/gamma"])
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, adapters=catalog, adapter_memory_bytes=cap)
    bank = engine.adapters
    bank.check("alpha")
    bank.check("team/gamma")
    assert bank.resident_names() == ["alpha", "team/gamma"]
    bank.check("alpha")  # used again: gamma is now the least recently used
    assert bank.resident_names() == ["team/gamma", "alpha"]
    bank.check("beta")  # needs the whole cap: both go
    assert bank.resident_names() == ["beta"] and bank.evictions == 2
    # A request decoding with beta holds it: alpha comes in over the cap rather than fail, and the
    # excess goes once beta's sequence ends.
    scheduler = BatchScheduler(engine, max_num_seqs=4)
    body = {"prompt_token_ids": prompt_ids(2, 7), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert scheduler.admit("b", {**body, "adapter": "beta"}) is None
    scheduler.step()
    bank.check("alpha")
    assert set(bank.resident_names()) == {"beta", "alpha"} and bank.resident_bytes > cap
    results = run_all(scheduler, {"a": {**body, "adapter": "alpha"}})
    while len(scheduler):
        scheduler.step()
    assert results["a"].status == "finished"
    assert bank.resident_bytes <= cap and "beta" not in bank.resident_names()
    with pytest.raises(ValueError, match="adapter: 'beta' needs"):
        CompiledEngine(model, tokenizer, adapters=catalog, adapter_memory_bytes=cap // 4).adapters.check("beta")


def test_an_engine_without_adapters_fails_adapter_requests_naming_adapter():
    from worker.engines.fake import FakeEngine
    from worker.engines.vision import VisionEngine

    scheduler = BatchScheduler(FakeEngine(), max_num_seqs=4)
    refused = scheduler.admit("f", {"prompt_token_ids": [1, 2], "max_tokens": 2, "adapter": "alpha"})
    assert refused.status == "failed" and refused.error.type == "InvalidRequest"
    assert refused.error.message == "adapter: 'alpha' cannot run here: this worker's engine serves no LoRA adapters"
    assert VisionEngine.adapter_batching is None and "vision" in VisionEngine.adapter_refusal
