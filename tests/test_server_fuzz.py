"""The server fuzzed from its own /openapi.json (schemathesis), as vLLM fuzzes its OpenAI server:
requests generated from the published request bodies, valid and invalid, must never get a 5xx
or hang, every 4xx must be in OpenAI's error shape, and the server must serve normally after."""

from __future__ import annotations

from typing import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from qrun.async_llm import AsyncLLM  # noqa: E402
from qrun.server import build_app  # noqa: E402
from test_server import ENGINE_ARGS, MODEL, live_server, request, wait_idle  # noqa: E402

# Per operation, both the schema-conforming and the schema-violating generation modes: ~2 min
# for the five operations on the tiny model on 2 cores.
EXAMPLES_PER_OPERATION = 60
# No request on the tiny model takes long; one that does is a hang.
REQUEST_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fuzzed_url(tiny_llama_dir) -> Iterator[str]:
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS)
    try:
        with live_server(build_app(engine, model_name=MODEL)) as base:
            yield base
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(fuzzed_url):
    return schemathesis.openapi.from_url(f"{fuzzed_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schemathesis.check
def errors_in_openai_shape(ctx, response, case) -> None:
    """Every 4xx answers {"error": {message, type, param, code}} with code the HTTP status."""
    if not 400 <= response.status_code < 500:
        return
    assert "error" in response.json(), (case.method, case.path, case.headers, case.query, response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert "param" in error and error["code"] == response.status_code, error


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_server_error_and_openai_shaped_errors(case):
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=[not_a_server_error, errors_in_openai_shape])


def test_server_serves_normally_after_the_fuzzing(fuzzed_url):
    # Runs after the fuzzing test in this module: nothing it sent may leave the engine stuck.
    wait_idle(fuzzed_url, timeout=60)
    assert request(fuzzed_url, "/health")[0] == 200
    # ignore_eos: sampled at the default temperature, the tiny model's EOS ends ~1% of such requests early
    status, _, reply = request(fuzzed_url, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 4
