"""schemathesis against the gateway's own OpenAPI schema, served live (a real Redis and a fake-engine worker):
no 5xx, and every response matches the schema (status codes, content types, bodies), and schema-invalid
requests are refused. The example count is bounded so the whole run takes seconds.

One built-in check is left out: that every schema-valid request is accepted. The gateway also refuses,
with a 400 naming the field, what a JSON schema cannot say: rules across fields (`max_tokens` with
`max_completion_tokens`, `top_logprobs` without `logprobs`), and the deployment's limits and priorities."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, settings

from schemathesis.specs.openapi.checks import positive_data_acceptance

from mlxq.redis_server import RedisServer
from producer.api.app import create_app
from producer.api.settings import GatewaySettings
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_fake_worker, stop

KEY = "sk-schema-test"
# Examples that reach the worker (the generated ones mostly name models no worker serves: 404).
EXAMPLES = {
    "ChatCompletionRequest": {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "logprobs": True, "top_logprobs": 2, "n": 2, "return_token_ids": True},
    "CompletionRequest": {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1},
    "GenerationRequest": {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True},
}


def _with_examples(document: dict) -> dict:
    for name, example in EXAMPLES.items():
        document["components"]["schemas"][name]["example"] = example
    return document


schema = schemathesis.openapi.from_dict(_with_examples(create_app(GatewaySettings()).openapi()))


@schema.auth()
class BearerKey:
    """The API key, set the way schemathesis sets auth, so its own cases without it stay without it."""

    def get(self, case: schemathesis.Case, context: schemathesis.AuthContext) -> str:
        return KEY

    def set(self, case: schemathesis.Case, data: str, context: schemathesis.AuthContext) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@pytest.fixture(scope="module")
def gateway_root() -> Iterator[str]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start_fake_worker(server.url, "--model", "fake", step_delay_s=0.0)
        try:
            wait_live(conn, "fake")
            with running_gateway(server.url, api_keys=key_entry("t", KEY), max_tokens=32,
                                 request_timeout_s=30) as base:
                yield base.removesuffix("/v1")
        finally:
            stop(worker)


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_honours_its_schema(case: schemathesis.Case, gateway_root: str) -> None:
    case.call_and_validate(base_url=gateway_root, timeout=30, excluded_checks=[positive_data_acceptance])
