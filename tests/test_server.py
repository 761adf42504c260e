"""The OpenAI-compatible server, tested live: uvicorn on a free loopback port, real HTTP clients."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from qrun.async_llm import AsyncLLM  # noqa: E402
from qrun.llm import LLM  # noqa: E402
from qrun.sampling_params import SamplingParams  # noqa: E402
from qrun.server import build_app  # noqa: E402
from qrun.server.protocol import MAX_BODY_BYTES, MAX_N, MAX_PROMPTS, MAX_STOP_STRINGS, SEED_MAX  # noqa: E402

ENGINE_ARGS = dict(device="cpu", kv_cache_memory=4_000_000, max_num_seqs=64, max_num_batched_tokens=512)
PROMPTS = [f"prompt {i}: the {'quick ' * (i % 5)}brown fox" for i in range(32)]
MODEL = "tiny"
# Loopback requests must never go through a proxy named in the environment.
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app) -> Iterator[str]:
    """Serve `app` from a thread on 127.0.0.1; yield its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def url(llm) -> Iterator[str]:
    with live_server(build_app(llm, model_name=MODEL)) as base:
        yield base


def _greedy(offline: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    outs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            progress=False)
    return [o.text for o in outs]


def request(url: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, Any, dict]:
    """(status, headers, parsed body) of one plain HTTP request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with NO_PROXY.open(req, timeout=30) as resp:
            raw, status, hdrs = resp.read(), resp.status, resp.headers
    except urllib.error.HTTPError as err:
        raw, status, hdrs = err.read(), err.code, err.headers
    text = raw.decode()
    return status, hdrs, (json.loads(text) if text.startswith("{") else {"text": text})


def post_raw(url: str, path: str, raw: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    """(status, parsed body) of a POST whose body is `raw` as is, for bodies no dict can be."""
    req = urllib.request.Request(url + path, data=raw, headers={"Content-Type": content_type})
    try:
        with NO_PROXY.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def metrics(url: str) -> dict[str, float]:
    _, _, body = request(url, "/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^(qrun_[\w{}="]+) (\S+)$', body["text"], re.M)}


def wait_idle(url: str, timeout: float = 10) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        if (m["qrun_requests_running"] == 0 and m["qrun_kv_blocks_used"] == 0 and m["qrun_kv_block_references"] == 0
                and m["qrun_http_requests_in_flight"] == 0):
            return m
        assert time.time() < deadline, f"server did not return to idle: {m}"
        time.sleep(0.05)


def client(url: str, api_key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


# -- the openai client -------------------------------------------------------------------------
def test_models_and_health(url):
    assert request(url, "/health")[0] == 200
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_completions_match_offline_greedy(url, offline):
    want = _greedy(offline, PROMPTS[:2], 12)
    c = client(url)
    got = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    assert got.choices[0].text == want[0] and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    streamed = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want[1]
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_matches_offline_greedy(url, offline, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    want = _greedy(offline, [prompt], 10)[0]
    c = client(url)
    got = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                    logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert len(got.choices[0].logprobs.content) == 10
    assert all(len(t.top_logprobs) == 2 for t in got.choices[0].logprobs.content)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_string_or_token_is_reported_as_the_stop_reason(url, offline):
    text = _greedy(offline, [PROMPTS[0]], 12)[0]
    stop = text[4:7]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stop": [stop]}
    _, _, answer = request(url, "/v1/completions", body)
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["stop_reason"] == stop
    chunks = list(client(url).completions.create(**body, stream=True))
    assert chunks[-1].choices[0].stop_reason == stop and chunks[0].choices[0].stop_reason is None
    messages = [{"role": "user", "content": PROMPTS[0]}]
    token = offline.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                         progress=False)[0].token_ids[2]
    _, _, answer = request(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 30,
                                                         "temperature": 0, "stop_token_ids": [token],
                                                         "ignore_eos": True})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == token
    _, _, answer = request(url, "/v1/completions", {**body, "stop": None, "ignore_eos": True})
    assert answer["choices"][0]["finish_reason"] == "length" and answer["choices"][0]["stop_reason"] is None


def test_logit_bias_bans_a_token_and_forces_another(url, offline):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    _, _, plain = request(url, "/v1/completions", {**body, "logprobs": 0})
    _, _, forced = request(url, "/v1/completions", {**body, "logit_bias": {"9": 100}})
    assert forced["choices"][0]["text"] == offline.tokenizer.decode([9] * 5)
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    greedy = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0), progress=False)[0]
    banned_id = greedy.token_ids[0]
    _, _, banned = request(url, "/v1/completions", {**body, "logit_bias": {str(banned_id): -100}, "logprobs": 0})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    status, _, reply = request(url, "/v1/completions", {**body, "logit_bias": {"999999": 1}})
    assert status == 400 and "outside the vocabulary" in reply["error"]["message"]


def test_n_and_seed(url):
    c = client(url)
    got = c.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=3, seed=7, temperature=1.0)
    assert sorted(ch.index for ch in got.choices) == [0, 1, 2]
    again = c.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=3, seed=7, temperature=1.0)
    assert [ch.text for ch in got.choices] == [ch.text for ch in again.choices]


# -- concurrency -------------------------------------------------------------------------------
def test_32_concurrent_streams_batch_and_match_offline(url, offline):
    max_tokens = 24
    want = _greedy(offline, PROMPTS, max_tokens)
    peak_running = 0

    async def one(c: "openai.AsyncOpenAI", prompt: str) -> str:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        parts, reasons = [], []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        return "".join(parts)

    async def watch(done: asyncio.Event) -> None:
        nonlocal peak_running
        while not done.is_set():
            m = await asyncio.to_thread(metrics, url)
            peak_running = max(peak_running, m["qrun_requests_running"])
            await asyncio.sleep(0.02)

    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))
        finally:
            done.set()
            await watcher
            await c.close()

    got = asyncio.run(main())
    assert got == want
    assert peak_running > 1
    m = wait_idle(url)
    assert m["qrun_time_to_first_token_seconds_count"] >= 32


def test_disconnect_mid_stream_frees_blocks(url):
    before = wait_idle(url)["qrun_generation_tokens_total"]
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    assert metrics(url)["qrun_kv_blocks_used"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    m = wait_idle(url)
    assert m["qrun_generation_tokens_total"] - before < 400  # aborted, not run to max_tokens
    status, _, body = request(url, "/v1/completions", {"prompt": "still here", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": "two"}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "n": MAX_N + 1}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
])
def test_bad_fields_are_400_naming_the_field(url, body, param):
    status, _, reply = request(url, "/v1/completions", {"model": MODEL, "unknown_field": 1, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and param in reply["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": "yes"}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 17}, "min_tokens"),  # above the default max_tokens, 16
])
def test_bad_nested_and_dependent_fields_are_400_naming_the_field(url, path, body, param):
    status, _, reply = request(url, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw, content_type", [(b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                                               (b"\xff\xfe", "application/json"), (b"", "application/json"),
                                               (b'{"prompt": "x"}', "text/plain")])
def test_a_body_that_is_no_json_object_is_400_in_openai_shape(url, raw, content_type):
    status, reply = post_raw(url, "/v1/completions", raw, content_type)
    error = reply["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] is None
    assert "body" in error["message"]


def test_a_body_over_the_limit_is_413_whether_declared_or_chunked(url):
    body = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()
    status, reply = post_raw(url, "/v1/completions", body)
    assert status == 413 and str(MAX_BODY_BYTES) in reply["error"]["message"]
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    chunks = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    conn.request("POST", "/v1/completions", chunks, {"Content-Type": "application/json"}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == 413
    conn.close()
    assert request(url, "/health")[0] == 200


def test_unknown_endpoints_and_methods_answer_in_openai_shape(url):
    status, _, reply = request(url, "/v1/engines")
    assert status == 404 and "/v1/engines" in reply["error"]["message"] and reply["error"]["code"] == 404
    status, headers, reply = request(url, "/v1/completions")  # GET
    assert status == 405 and "GET" in reply["error"]["message"] and headers["allow"] == "POST"


def test_whole_number_floats_are_integers_as_json_schema_says(url):
    status, _, reply = request(url, "/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 2.0, "n": 2.0,
                                                        "top_k": -1.0, "seed": 7.0, "logprobs": 1.0})
    assert status == 200, reply
    assert len(reply["choices"]) == 2 and reply["usage"]["completion_tokens"] == 4


def test_null_fields_take_their_defaults_and_the_largest_values_are_served(url):
    status, _, reply = request(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": None,
                                                        "stop": None, "stream_options": None})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    # top_k beyond any vocabulary (or int64) and the largest seed, with n choices seeded seed + i.
    status, _, reply = request(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": 2**70,
                                                        "seed": SEED_MAX, "n": MAX_N})
    assert status == 200 and len(reply["choices"]) == MAX_N


def test_openapi_describes_the_request_bodies(url):
    status, _, spec = request(url, "/openapi.json")
    assert status == 200
    schemas = spec["components"]["schemas"]
    for path, model, fields in [
        ("/v1/completions", "CompletionRequest", {"prompt", "max_tokens", "stream", "n", "logprobs", "echo"}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages", "max_tokens", "stream", "top_logprobs"}),
    ]:
        operation = spec["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert fields <= set(schemas[model]["properties"])
        # Errors are OpenAI's shape with status 400, not FastAPI's 422.
        assert "422" not in operation["responses"]
        assert operation["responses"]["4XX"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["ChatMessage"]["required"] == ["role"]
    n = next(s for s in schemas["CompletionRequest"]["properties"]["n"]["anyOf"] if s["type"] == "integer")
    assert (n["minimum"], n["maximum"]) == (1, MAX_N)
    seed = next(s for s in schemas["CompletionRequest"]["properties"]["seed"]["anyOf"] if s["type"] == "integer")
    assert seed["maximum"] == SEED_MAX  # exact, though the schema's bounds are doubles


def test_request_that_can_never_fit_is_400(url, llm):
    too_long = llm.engine.max_model_len + 10
    status, _, reply = request(url, "/v1/completions", {"prompt": "x", "max_tokens": too_long})
    assert status == 400 and "context" in reply["error"]["message"]
    status, _, reply = request(url, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and reply["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client(url).completions.create(model=MODEL, prompt="x", max_tokens=too_long, stream=True)
    assert request(url, "/health")[0] == 200
    wait_idle(url)


def test_api_key(llm):
    with live_server(build_app(llm, api_key="sekret", model_name=MODEL)) as base:
        status, _, reply = request(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert request(base, "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        got = client(base, "sekret").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert got.usage.completion_tokens >= 1
        assert request(base, "/health")[0] == 200


def test_the_api_key_is_checked_before_the_body(llm):
    with live_server(build_app(llm, api_key="sekret", model_name=MODEL)) as base:
        assert request(base, "/v1/completions", {"prompt": 12})[0] == 401
        assert post_raw(base, "/v1/chat/completions", b"{not json")[0] == 401
        status, _, reply = request(base, "/v1/completions", {"prompt": 12}, {"Authorization": "Bearer sekret"})
        assert status == 400 and reply["error"]["param"] == "prompt"


def test_queue_full_is_429(tiny_llama_dir):
    # One engine slot and no queue: a second request while one streams is turned away.
    small = AsyncLLM(str(tiny_llama_dir), **{**ENGINE_ARGS, "max_num_seqs": 1})
    try:
        with live_server(build_app(small, max_queue=0, model_name=MODEL)) as base:
            conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": "busy", "max_tokens": 300, "ignore_eos": True, "stream": True}),
                {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.readline().startswith(b"data: ")
            status, headers, reply = request(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert reply["error"]["type"] == "rate_limit_error"
            assert metrics(base)['qrun_http_requests_total{status="429"}'] == 1  # /metrics counts every answer
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            wait_idle(base)
            status, _, reply = request(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200
    finally:
        small.shutdown()
