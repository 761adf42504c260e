"""Security defaults of the server: the API key compared in constant time, loopback unless told
otherwise (and a warning when exposed without a key), no request field reaching the file system,
no CORS unless enabled."""

from __future__ import annotations

import argparse
import hmac
import http.client
import json
import logging
import sys

import pytest

from test_server import MODEL, _greedy, live_server, llm, offline, request, url  # noqa: F401 - fixtures

from qrun.server import build_app, command

# Read by an audit hook that can never be removed: it records only while a test sets `probe`.
_file_access: dict[str, object] = {"probe": None, "seen": []}


def _record_file_access(event: str, args: tuple) -> None:
    probe = _file_access["probe"]
    if probe is not None and event in ("open", "os.listdir", "os.scandir") and probe in str(args[0]):
        _file_access["seen"].append((event, args[0]))


sys.addaudithook(_record_file_access)


def _raw_status(base: str, method: str, path: str, headers: dict[str, str], body: bytes | None = None
                ) -> tuple[int, dict[str, str]]:
    """(status, lower-cased headers) of one request sent exactly as given."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body, headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


# -- the API key --------------------------------------------------------------------------------
def test_the_api_key_is_compared_in_constant_time(llm, monkeypatch):
    compared = []
    constant_time = hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    with live_server(build_app(llm, api_key="sekret", model_name=MODEL)) as base:
        assert request(base, "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert request(base, "/v1/models", headers={"Authorization": "Bearer sekret"})[0] == 200
    assert compared == [(b"Bearer wrong", b"Bearer sekret"), (b"Bearer sekret", b"Bearer sekret")]


def test_a_non_ascii_authorization_header_is_a_401(llm):
    with live_server(build_app(llm, api_key="sekret", model_name=MODEL)) as base:
        status, _ = _raw_status(base, "GET", "/v1/models", {"Authorization": "Bearer s\xe9kret"})
        assert status == 401


def test_the_api_key_may_come_from_the_environment(monkeypatch):
    # Keeps the key out of the process list, where --api-key would show it.
    monkeypatch.setenv("QRUN_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    assert parser.parse_args(["m"]).api_key == "from-env"
    assert parser.parse_args(["m", "--api-key", "given"]).api_key == "given"


# -- where it listens ---------------------------------------------------------------------------
def test_serve_binds_loopback_unless_told_otherwise():
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    assert parser.parse_args(["m"]).host == "127.0.0.1"


@pytest.mark.parametrize("host, api_key, warned", [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("myhost.example", None, True),
    ("0.0.0.0", "sekret", False),
])
def test_serve_warns_when_binding_beyond_loopback_without_an_api_key(monkeypatch, caplog, host, api_key, warned):
    class Loading(Exception):
        """Raised where the model would load: the warning must come before that slow step."""

    def load(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(command, "AsyncLLM", load)
    monkeypatch.delenv("QRUN_API_KEY", raising=False)
    argv = ["m", "--host", host] + (["--api-key", api_key] if api_key else [])
    with caplog.at_level(logging.WARNING, logger="qrun.server"), pytest.raises(Loading):
        command.main(argv)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) == warned, warnings
    if warned:
        assert host in warnings[0] and "--api-key" in warnings[0]


# -- no path from a request to the file system --------------------------------------------------
def test_the_model_field_selects_nothing_on_disk(url, offline, tiny_checkpoints):
    # Another model really is on disk there; the reply still comes from the one served.
    other = str(tiny_checkpoints["qwen2"])
    want = _greedy(offline, ["abc"], 4)[0]
    _file_access.update(probe=other, seen=[])
    try:
        for model in (other, other + "/config.json", "../" * 8 + other.lstrip("/")):
            status, _, reply = request(url, "/v1/completions", {"model": model, "prompt": "abc", "max_tokens": 4,
                                                               "temperature": 0, "ignore_eos": True})
            assert status == 200 and reply["model"] == MODEL and reply["choices"][0]["text"] == want
    finally:
        _file_access["probe"] = None
    assert _file_access["seen"] == []


def test_a_json_schema_ref_to_a_file_or_url_is_refused_not_fetched(url, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "string"}))  # a valid schema: fetching it would succeed
    for ref in (schema.as_uri(), str(schema), "http://127.0.0.1:9/schema.json"):
        status, _, reply = request(url, "/v1/completions", {
            "prompt": "x", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": ref}}}})
        assert status == 400 and "does not fetch" in reply["error"]["message"], reply


# -- CORS ---------------------------------------------------------------------------------------
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = json.dumps({"prompt": "x", "max_tokens": 1}).encode()


def test_no_cors_headers_unless_origins_are_given(url):
    _, headers = _raw_status(url, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert not any(name.startswith("access-control-") for name in headers)
    status, headers = _raw_status(url, "POST", "/v1/completions",
                                  {"Origin": "https://app.example", "Content-Type": "application/json"}, BODY)
    assert status == 200 and not any(name.startswith("access-control-") for name in headers)


def test_cors_origins_answer_only_the_listed_origins(llm):
    app = build_app(llm, api_key="sekret", model_name=MODEL, cors_origins=["https://app.example"])
    with live_server(app) as base:
        status, headers = _raw_status(base, "OPTIONS", "/v1/completions", PREFLIGHT)  # no key: browsers send none
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in headers["access-control-allow-headers"].lower()
        status, headers = _raw_status(base, "OPTIONS", "/v1/completions",
                                      {**PREFLIGHT, "Origin": "https://evil.example"})
        assert status == 400 and "access-control-allow-origin" not in headers
        status, headers = _raw_status(base, "POST", "/v1/completions", {
            "Origin": "https://app.example", "Content-Type": "application/json",
            "Authorization": "Bearer sekret"}, BODY)
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        status, headers = _raw_status(base, "POST", "/v1/completions", {
            "Origin": "https://app.example", "Content-Type": "application/json"}, BODY)
        assert status == 401  # CORS lets a page read answers; it needs the key all the same


@pytest.mark.parametrize("value, origins", [
    ("https://app.example", ["https://app.example"]),
    ("https://a.example, http://b.example:8080", ["https://a.example", "http://b.example:8080"]),
    ("*", ["*"]),
])
def test_cors_origins_option_takes_a_comma_separated_list(value, origins):
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    assert parser.parse_args(["m"]).cors_origins is None
    assert parser.parse_args(["m", "--cors-origins", value]).cors_origins == origins


@pytest.mark.parametrize("value", ["https://app.example/", "app.example", "ftp://app.example", ",", "https://"])
def test_cors_origins_option_refuses_what_no_browser_sends_as_an_origin(value, capsys):
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["m", "--cors-origins", value])
    assert exit_info.value.code == 2 and "--cors-origins" in capsys.readouterr().err
