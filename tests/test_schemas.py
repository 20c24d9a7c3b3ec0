"""Request/result schemas: strict, every error names its field."""

from __future__ import annotations

import pytest

from schemas import GenerationRequest, GenerationResult, InvalidRequestError, RequestLimits, keys


def rejects(payload, field, limits=None):
    with pytest.raises(InvalidRequestError) as info:
        GenerationRequest.validate_payload(payload, limits)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    return str(info.value)


def test_exactly_one_input():
    rejects({}, "prompt")
    rejects({"prompt": "a", "prompt_token_ids": [1]}, "prompt")
    assert GenerationRequest.validate_payload({"prompt_token_ids": [1, 2]}).prompt_token_ids == [1, 2]
    assert GenerationRequest.validate_payload({"messages": [{"role": "user", "content": "hi"}]}).messages


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"prompt": "x", "unknown": 1}, "unknown"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "12"}, "max_tokens"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -1}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"prompt": "x", "logprobs": "yes"}, "logprobs"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids.1"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "messages.0.content"),
        ({"prompt": "x", "metadata": {"k": 5}}, "metadata.k"),
    ],
)
def test_out_of_range_and_unknown_fields_are_named(payload, field):
    rejects(payload, field)


def test_limits_are_configurable_and_named():
    limits = RequestLimits(max_tokens=10, max_prompt_tokens=3, max_prompt_chars=5)
    assert "limit of 10" in rejects({"prompt": "x", "max_tokens": 11}, "max_tokens", limits)
    rejects({"prompt_token_ids": [1, 2, 3, 4]}, "prompt_token_ids", limits)
    rejects({"prompt": "abcdef"}, "prompt", limits)
    rejects({"messages": [{"role": "user", "content": "abcdef"}]}, "messages", limits)
    assert GenerationRequest.validate_payload({"prompt": "abc", "max_tokens": 10}, limits).max_tokens == 10


def test_non_object_payload():
    assert "expected a JSON object" in rejects("prompt", "request")


def test_logit_bias_keys_arrive_as_strings_and_become_ids():
    request = GenerationRequest.validate_payload({"prompt": "x", "logit_bias": {"17": -100}})
    assert request.logit_bias == {17: -100.0}
    assert request.to_payload() == {"prompt": "x", "logit_bias": {"17": -100.0}}


def test_payload_round_trip_keeps_only_set_fields():
    payload = {"prompt": "x", "temperature": 0.0, "stop": "END", "n": 2}
    request = GenerationRequest.validate_payload(payload)
    assert request.to_payload() == payload
    assert request.stop_strings == ["END"]
    assert GenerationRequest.validate_payload(request.to_payload()) == request


def test_result_is_strict_too():
    result = GenerationResult(id="j", status="finished")
    assert GenerationResult.model_validate_json(result.model_dump_json()) == result
    with pytest.raises(ValueError):
        GenerationResult.model_validate({"id": "j", "status": "done"})


def test_key_names_and_routing():
    assert keys.result_key("a") == "mlxq:result:a"
    assert keys.stream_key("a") == "mlxq:stream:a"
    assert keys.cancel_key("a") == "mlxq:cancel:a"
    assert keys.queue_for_model(None) == "mlxq"
    assert keys.queue_for_model("qwen") == "mlxq:qwen"
    assert keys.model_alias("mlx-community/Qwen2.5-0.5B/") == "Qwen2.5-0.5B"


def test_schemas_import_no_mlx():
    import subprocess
    import sys

    code = "import schemas, sys; assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'worker')]"
    subprocess.run([sys.executable, "-c", code], check=True)
