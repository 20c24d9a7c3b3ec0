"""The vision engine on a real (tiny, random-weight) qwen2_vl: image and text requests batched
together, some joining mid-decode, give the token ids and logprobs of the same request run alone
through mlx-vlm; per-row sampling, n, stops, logprobs modes and memory admission hold on this path."""

from __future__ import annotations

import math

import numpy as np
import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx

from schemas import GenerationRequest
from tests.pictures import chat, picture
from tests.reference import run_all, vlm_alone
from worker.engines.vision import VisionEngine
from worker.scheduler import BatchScheduler


@pytest.fixture(scope="module")
def vlm(tiny_vision_model_dir):
    from mlx_vlm import load

    return load(tiny_vision_model_dir)


def alone(engine: VisionEngine, request: dict, **kwargs):
    prompt = engine.prepare(GenerationRequest.validate_payload(request))
    return prompt, vlm_alone(engine.model, prompt, request["max_tokens"], **kwargs)


def test_batched_image_and_text_requests_joining_mid_decode_equal_each_alone_through_mlx_vlm(vlm):
    model, processor = vlm
    engine = VisionEngine(model, processor, max_num_seqs=6, prefill_batch_size=3)
    scheduler = BatchScheduler(engine, max_num_seqs=6)
    greedy = {"temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    requests = {
        "img-a": chat("what is this", picture(1), max_tokens=12, **greedy),
        "img-b": chat("and this one?", picture(2, (40, 100)), image_first=False, max_tokens=7, **greedy),
        "text-chat": chat("no picture here", max_tokens=9, **greedy),
        "two-img": chat("compare", picture(3, (70, 42)), picture(4, (28, 28), "JPEG"), max_tokens=15, **greedy),
        "raw-prompt": {"prompt": "Hello world!", "max_tokens": 5, **greedy},
        "ids": {"prompt_token_ids": [7, 8, 9, 10, 11, 12], "max_tokens": 11, **greedy},
        "img-c": chat("describe", picture(5, (90, 60), "WEBP"), max_tokens=6, **greedy),
        "img-eos": chat("stops at EOS", picture(6), max_tokens=20, temperature=0, logprobs=True),
    }
    pending, results, steps, joined_mid_decode = list(requests), {}, 0, 0
    for job_id in pending[:2]:
        assert scheduler.admit(job_id, requests[job_id]) is None
    pending = pending[2:]
    while pending or len(scheduler):
        if pending and steps % 2 == 1 and scheduler.free_slots:
            joined_mid_decode += scheduler.decoding
            job_id = pending.pop(0)
            assert scheduler.admit(job_id, requests[job_id]) is None
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        steps += 1
    assert joined_mid_decode >= 4
    assert engine.num_active == 0
    for job_id, request in requests.items():
        result = results[job_id]
        assert result.status == "finished", (job_id, result.error)
        stops = set() if request.get("ignore_eos") else set(engine.eos_token_ids)
        prompt, (ref_tokens, ref_distributions) = alone(engine, request, stop_ids=stops)
        choice = result.choices[0]
        assert choice.token_ids == ref_tokens, job_id
        ref_logprobs = [float(d[t]) for t, d in zip(ref_tokens, ref_distributions)]
        assert choice.logprobs == pytest.approx(ref_logprobs, abs=1e-3), job_id
        if request.get("top_logprobs"):
            for top, d in zip(choice.top_logprobs, ref_distributions):
                assert [t.token_id for t in top][:1] == [int(mx.argmax(d))]
                assert [t.logprob for t in top] == pytest.approx(sorted(np.array(d).tolist())[::-1][:3], abs=1e-3)
        assert result.usage.prompt_tokens == len(prompt.token_ids)
        assert result.usage.completion_tokens == len(ref_tokens)
    two = engine.prepare(GenerationRequest.validate_payload(requests["two-img"]))
    merged_patches = int(np.prod(np.array(two.inputs.image_grid_thw), axis=1).sum()) // 4  # 2 x 2 patches a token
    assert two.token_ids.count(model.config.image_token_id) == merged_patches > 2
    stats = engine.stats().counters
    assert stats["vision_calls"] == 5 and stats["images"] == 6


def test_the_image_changes_the_output_and_the_same_image_gives_the_same(vlm):
    model, processor = vlm
    engine = VisionEngine(model, processor)
    requests = {f"j{i}": chat("what do you see", picture(seed), max_tokens=8, temperature=0, logprobs=True,
                              ignore_eos=True) for i, seed in enumerate((10, 11, 10))}
    results = run_all(BatchScheduler(engine), requests)
    a, b, same = (results[j].choices[0] for j in ("j0", "j1", "j2"))
    assert a.token_ids == same.token_ids and a.logprobs == pytest.approx(same.logprobs, abs=1e-5)
    assert a.logprobs != pytest.approx(b.logprobs, abs=1e-3)


def test_per_row_sampling_greedy_beside_hot_rows_and_a_seeded_image_request_alone_equals_in_a_crowd(vlm):
    model, processor = vlm
    seeded = chat("tell me a story", picture(20), max_tokens=14, temperature=0.9, top_p=0.95, seed=1234, n=3,
                  ignore_eos=True)
    greedy = chat("tell me a story", picture(21), max_tokens=10, temperature=0, seed=3, ignore_eos=True)
    alone_run = run_all(BatchScheduler(VisionEngine(model, processor)), {"s": seeded})["s"]
    crowd = {"s": seeded, "g": greedy}
    for i in range(5):  # hot rows: high temperature, some filtered, some penalised, some seeded differently
        crowd[f"hot{i}"] = chat(f"noise {i}", picture(30 + i), max_tokens=12, temperature=1.6, top_k=5 * i,
                                presence_penalty=0.5 * (i % 2), ignore_eos=True, **({"seed": i} if i % 2 else {}))
    crowd["text-hot"] = {"prompt": "some text", "max_tokens": 9, "temperature": 1.8, "ignore_eos": True}
    engine = VisionEngine(model, processor, max_num_seqs=16)
    results = run_all(BatchScheduler(engine, max_num_seqs=16), crowd)
    assert all(r.status == "finished" for r in results.values())
    in_crowd = results["s"]
    assert [c.token_ids for c in in_crowd.choices] == [c.token_ids for c in alone_run.choices]
    assert len({tuple(c.token_ids) for c in in_crowd.choices}) == 3  # the choices draw under their own keys
    _, (ref_tokens, _) = alone(engine, greedy)
    assert results["g"].choices[0].token_ids == ref_tokens


def test_n_choices_share_one_vision_encoding_and_match_the_request_alone(vlm):
    model, processor = vlm
    engine = VisionEngine(model, processor)
    request = chat("four of the same", picture(40), max_tokens=9, n=4, temperature=0, logprobs=True,
                   ignore_eos=True)
    result = run_all(BatchScheduler(engine), {"n4": request})["n4"]
    assert engine.stats().counters["vision_calls"] == 1 and engine.stats().counters["images"] == 1
    _, (ref_tokens, ref_distributions) = alone(engine, request)
    ref_logprobs = [float(d[t]) for t, d in zip(ref_tokens, ref_distributions)]
    for choice in result.choices:
        assert choice.token_ids == ref_tokens
        assert choice.logprobs == pytest.approx(ref_logprobs, abs=1e-3)
    assert result.usage.completion_tokens == 4 * len(ref_tokens)


def test_stop_ids_stop_strings_and_both_logprobs_modes_on_image_requests(vlm):
    model, processor = vlm
    engine = VisionEngine(model, processor)
    base = chat("stop somewhere", picture(50), max_tokens=16, temperature=0, ignore_eos=True)
    _, (tokens, distributions) = alone(engine, base)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    text = engine.decode(tokens)
    stop_text = next(engine.decode(tokens[i:i + 1]) for i in range(1, len(tokens))
                     if engine.decode(tokens[i:i + 1]).strip() and engine.decode(tokens[i:i + 1]) in text)
    forced = tokens[0]
    requests = {
        "stop-id": {**base, "stop_token_ids": [tokens[k]]},
        "stop-str": {**base, "stop": stop_text},
        "processed": {**base, "top_k": 2, "logprobs": True, "logprobs_mode": "processed"},
        "raw-biased": {**base, "logit_bias": {str(forced): 100.0}, "logprobs": True, "max_tokens": 6},
        "processed-biased": {**base, "logit_bias": {str(forced): 100.0}, "logprobs": True, "max_tokens": 6,
                             "logprobs_mode": "processed"},
    }
    results = run_all(BatchScheduler(engine), requests)
    stopped = results["stop-id"].choices[0]
    assert stopped.token_ids == tokens[: k + 1] and stopped.finish_reason == "stop"
    cut = results["stop-str"].choices[0]
    assert cut.finish_reason == "stop" and stop_text not in cut.text and text.startswith(cut.text)
    processed = results["processed"].choices[0]
    assert processed.token_ids == tokens
    for lp, d in zip(processed.logprobs, distributions):
        top2 = sorted(np.array(d).tolist())[::-1][:2]
        assert lp == pytest.approx(top2[0] - math.log(math.exp(top2[0]) + math.exp(top2[1])), abs=1e-3)
    prompt = engine.prepare(GenerationRequest.validate_payload(requests["raw-biased"]))
    forced_tokens, forced_distributions = vlm_alone(model, prompt, 6, sampler=lambda x: mx.array([forced]))
    raw = results["raw-biased"].choices[0]
    assert raw.token_ids == forced_tokens == [forced] * 6
    assert raw.logprobs == pytest.approx([float(d[forced]) for d in forced_distributions], abs=1e-3)
    assert results["processed-biased"].choices[0].logprobs == pytest.approx([0.0] * 6, abs=1e-3)


def test_sixty_four_image_jobs_on_a_small_kv_budget_enter_a_few_at_a_time_and_all_finish(vlm):
    model, processor = vlm
    engine = VisionEngine(model, processor, max_num_seqs=32)
    requests = {f"j{i}": chat(f"picture {i}", picture(100 + i, (56 + 14 * (i % 3), 56)), max_tokens=24,
                              temperature=0, ignore_eos=True) for i in range(64)}
    one = engine.prepare(GenerationRequest.validate_payload(requests["j2"]))  # the largest image
    per_job = (len(one.token_ids) + 24) * engine.kv_bytes_per_token
    budget = 3 * per_job + one.extra_bytes  # three decoding beside one entering: its encoder costs more
    scheduler = BatchScheduler(engine, max_num_seqs=32, kv_budget_bytes=budget)
    for job_id, request in requests.items():
        assert scheduler.admit(job_id, request) is None  # each one fits alone: none fails for memory
    results, peak = {}, 0
    while len(scheduler):
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        peak = max(peak, engine.num_active)
    assert len(results) == 64 and all(r.status == "finished" for r in results.values())
    assert 2 <= peak <= 5
    assert engine.stats().counters["peak_sequences"] == peak


def test_a_qwen2_5_vl_batch_equals_each_request_alone_through_mlx_vlm(tmp_path):
    from mlx_vlm import load

    from worker.tiny_model import make_tiny_vision_model

    model, processor = load(str(make_tiny_vision_model(tmp_path / "qwen2.5-vl", model_type="qwen2_5_vl")))
    engine = VisionEngine(model, processor)
    greedy = {"temperature": 0, "logprobs": True, "ignore_eos": True}
    requests = {"a": chat("first", picture(60), max_tokens=8, **greedy),
                "b": chat("second", picture(61, (84, 112)), picture(62), max_tokens=6, **greedy),
                "c": chat("words only", max_tokens=7, **greedy)}
    results = run_all(BatchScheduler(engine), requests)
    for job_id, request in requests.items():
        _, (tokens, distributions) = alone(engine, request)
        assert results[job_id].choices[0].token_ids == tokens, job_id
        assert results[job_id].choices[0].logprobs == pytest.approx([float(d[t]) for t, d in zip(tokens, distributions)],
                                                                    abs=1e-3)


def test_a_weight_version_swapped_in_between_steps_samples_the_next_tokens_and_stamps_them(vlm, tmp_path):
    from mlx_vlm import load

    from worker.tiny_model import make_tiny_vision_model

    model, processor = load(str(make_tiny_vision_model(tmp_path / "v0")))  # its own copy: the swap changes it
    engine = VisionEngine(model, processor)
    other = make_tiny_vision_model(tmp_path / "v1", seed=1)
    request = chat("before and after", picture(70), max_tokens=6, temperature=0, ignore_eos=True)
    before = run_all(BatchScheduler(engine), {"a": request})["a"]
    assert engine.parameter_spec() and engine.weight_version == 0
    engine.swap_weights([other / "model.safetensors"], 7)
    after = run_all(BatchScheduler(engine), {"b": request})["b"]
    new_model, new_processor = load(str(other))
    _, (expected, _) = alone(VisionEngine(new_model, new_processor), request)
    assert after.choices[0].token_ids == expected != before.choices[0].token_ids
    assert before.choices[0].weight_version == 0 and after.choices[0].weight_version == 7


def test_constrained_image_rows_beside_free_rows_each_under_its_own_constraint(vlm):
    import json
    import re

    import jsonschema

    model, processor = vlm
    engine = VisionEngine(model, processor, max_num_seqs=8)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    free = chat("describe", picture(3), max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    requests = {
        "schema": chat("as json", picture(4), max_tokens=24, temperature=0,
                       response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}),
        "regex": {"prompt": "code", "max_tokens": 12, "temperature": 0.7, "seed": 5, "guided_regex": "[a-c]{2}[0-9]"},
        "free": free,
    }
    results = run_all(BatchScheduler(engine, max_num_seqs=8), requests)
    regex = results["regex"].choices[0]
    assert regex.finish_reason == "stop" and re.fullmatch("[a-c]{2}[0-9]", regex.text) and regex.constraint_complete
    constrained = results["schema"].choices[0]
    if constrained.finish_reason == "stop":
        jsonschema.validate(json.loads(constrained.text), schema)
        assert constrained.constraint_complete
    else:
        assert constrained.text.startswith("{") and constrained.constraint_complete is False
    _, (tokens, distributions) = alone(engine, free)
    assert results["free"].choices[0].token_ids == tokens  # its neighbours' masks never reach it
    assert results["free"].choices[0].constraint_complete is None
