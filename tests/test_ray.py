"""qrun on Ray: batch jobs through Ray Data (QrunPredictor, `qrun generate --replicas`) and serving
through Ray Serve (`qrun serve --replicas`), on a local Ray instance of 2 CPUs whose replicas run
one thread each. The tests that start Ray are marked `ray`; all skip, saying why, without Ray."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from qrun.cli import main
from test_server import _free_port, client, request

RAY_MISSING = 'Ray is not installed: pip install -e ".[ray]"'
ENGINE_ARGS = dict(device="cpu", kv_cache_memory=8 * 2**20)
ENGINE_FLAGS = [flag for name, value in ENGINE_ARGS.items() for flag in (f"--{name.replace('_', '-')}", str(value))]


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray", reason=RAY_MISSING)
    # Replicas should run the threads Ray gives them (OMP_NUM_THREADS = their CPUs), as outside
    # the tests; conftest's fixed QRUN_THREADS, inherited through Ray's daemons, would give two.
    threads = os.environ.pop("QRUN_THREADS", None)
    try:
        context = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20,
                           logging_level=logging.WARNING)
    finally:
        if threads is not None:
            os.environ["QRUN_THREADS"] = threads
    yield context.address_info["gcs_address"]
    ray.shutdown()


def write_requests(path: Path, count: int) -> None:
    """`count` requests of mixed shapes, then one with a nested format field and two bad lines."""
    lines = []
    for i in range(count):
        if i % 3 == 0:
            lines.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}],
                          "max_tokens": 2 + i % 5})
        else:
            lines.append({"prompt": f"prompt {i}: the {'quick ' * (i % 7)}fox", "max_tokens": 2 + i % 5})
    lines += [{"prompt": "as json:", "max_tokens": 6, "response_format": {"type": "json_object"}},
              {"prompt": "typo", "max_token": 3}, {"prompt": "long", "max_tokens": 100_000}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


# -- without Ray ------------------------------------------------------------------------------
def test_replicas_without_ray_installed_say_how_to_install_it(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as where it is not installed
    source = tmp_path / "in.jsonl"
    write_requests(source, 2)
    for command in (["generate", str(tiny_llama_dir), "--input", str(source), "--replicas", "2"],
                    ["serve", str(tiny_llama_dir), "--replicas", "2"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err == 'qrun: error: --replicas 2 runs on Ray, which is not installed: pip install -e ".[ray]"\n'


def test_replica_flags_are_checked_as_usage(tiny_llama_dir, capsys):
    assert main(["generate", str(tiny_llama_dir), "hi", "--replicas", "2"]) == 2
    assert "a single prompt runs here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["generate", str(tiny_llama_dir), "--input", "x.jsonl", "--replicas", "0"])
    assert usage.value.code == 2 and "'0' is not a whole number >= 1" in capsys.readouterr().err


def test_one_replica_runs_in_this_process_without_importing_ray(tiny_llama_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    write_requests(source, 3)
    script = ("import sys\nfrom qrun.cli import main\n"
              f"code = main({['generate', str(tiny_llama_dir), '--input', str(source), '--replicas', '1', *ENGINE_FLAGS]!r})\n"
              "assert 'ray' not in sys.modules, 'ray was imported'\nraise SystemExit(code)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 6 and "4 requests (2 skipped)" in done.stderr
    assert "replicas" not in done.stderr


def test_predictor_answers_rows_of_every_shape_and_keeps_their_columns(tiny_llama_dir):
    pa = pytest.importorskip("pyarrow", reason=RAY_MISSING)
    from qrun import QrunPredictor
    from qrun.llm import LLM
    from qrun.sampling_params import SamplingParams

    llm = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    messages = [{"role": "user", "content": "hello"}]
    stop_id = llm.generate(["five"], SamplingParams(temperature=0, max_tokens=3), progress=False)[0].token_ids[1]
    expected = llm.generate(["one two", llm.tokenizer.encode_chat(messages), "three", "five"],
                            [SamplingParams(temperature=0, max_tokens=n) for n in (3, 5, 4)] +
                            [SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[stop_id])], progress=False)
    rows = [{"user": "a", "prompt": "one two", "max_tokens": 3},
            {"user": "b", "messages": messages},  # null max_tokens: the default's 5
            {"user": "c", "request": json.dumps({"prompt": "three", "max_tokens": 4, "stop": ["zz"]})},
            {"user": "f", "prompt": "five", "max_tokens": 3, "stop_token_ids": [stop_id]},
            {"user": "d", "prompt": "four", "max_tokens": 100_000},
            {"user": "e", "request": "{not json"}]
    predictor = QrunPredictor(str(tiny_llama_dir), sampling={"temperature": 0, "max_tokens": 5}, **ENGINE_ARGS)
    columns = dict.fromkeys(name for row in rows for name in row)  # from_pylist would take the first row's
    answered = predictor(pa.table({name: [row.get(name) for row in rows] for name in columns}))
    out = answered.to_pylist()

    assert [row["user"] for row in out] == ["a", "b", "c", "f", "d", "e"]
    assert (answered.schema.field("stop_string").type, answered.schema.field("stop_token_id").type) == (
        pa.string(), pa.int64())
    for row, output in zip(out, expected):
        assert row["error"] is None
        assert (row["text"], row["token_ids"], row["finish_reason"]) == (output.text, output.token_ids,
                                                                        output.finish_reason)
        assert (row["stop_string"], row["stop_token_id"]) == (None, output.stop_reason)
        assert row["completion_tokens"] == len(output.token_ids) and row["prompt_tokens"] > 0
    assert out[3]["finish_reason"] == "stop" and out[3]["stop_token_id"] == stop_id
    assert "exceeds" in out[4]["error"] and out[4]["text"] is None
    assert out[5]["error"].startswith("not JSON")
    with pytest.raises(TypeError, match="batch_format='pyarrow'"):
        predictor({"prompt": ["numpy batches turn a missing integer into NaN"]})


# -- on a local Ray instance ------------------------------------------------------------------
@pytest.mark.ray
def test_generate_with_2_replicas_writes_what_1_replica_writes(tiny_llama_dir, ray_address, tmp_path, capsys):
    source, one, two = tmp_path / "in.jsonl", tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    write_requests(source, 60)
    common = ["generate", str(tiny_llama_dir), "--input", str(source), "--temperature", "0", *ENGINE_FLAGS]
    assert main([*common, "--output", str(one)]) == 0
    capsys.readouterr()
    assert main([*common, "--output", str(two), "--replicas", "2", "--ray-address", ray_address]) == 0
    err = capsys.readouterr().err
    records = [json.loads(line) for line in two.read_text().splitlines()]
    # All but cached_tokens: which prompts share a prefix cache depends on the replica each ran on.
    assert [_without_cached(r) for r in records] == [_without_cached(json.loads(line))
                                                      for line in one.read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1, 64))
    assert records[0]["id"] == "c0" and records[60]["completion_tokens"] > 0  # the json_object line ran
    assert "in.jsonl:62: unknown field 'max_token'" in err and "in.jsonl:63:" in err
    assert "61 requests (2 skipped)" in err and "on 2 replicas" in err


@pytest.mark.ray
def test_replicas_that_cannot_load_the_model_end_in_one_line_naming_why(ray_address, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    write_requests(source, 2)
    assert main(["generate", str(tmp_path / "missing"), "--input", str(source), "--replicas", "2",
                 "--ray-address", ray_address]) == 1
    last = capsys.readouterr().err.splitlines()[-1]  # after Ray's own log of each attempt
    assert last.startswith("qrun: error: the replicas failed: model ") and "not found" in last
    assert last.endswith("(ModelLoadError; Ray's log above has more)")


@pytest.mark.ray
def test_a_replica_killed_mid_job_is_retried_without_losing_or_repeating_a_row(tiny_llama_dir, ray_address,
                                                                               tmp_path):
    import pyarrow as pa
    import ray
    import ray.data

    from qrun.ray_batch import QrunPredictor

    import killed_replica

    ray.cloudpickle.register_pickle_by_value(killed_replica)  # Ray's workers cannot import tests/
    prompts = [f"row {i}: the {'lazy ' * (i % 6)}dog" for i in range(48)]
    rows = [{"index": i, "prompt": p, "max_tokens": 2 + i % 4} for i, p in enumerate(prompts)]
    kwargs = {"model": str(tiny_llama_dir), "sampling": {"temperature": 0}, **ENGINE_ARGS}
    expected = QrunPredictor(**kwargs)(pa.Table.from_pylist(rows)).to_pylist()

    marker = tmp_path / "killed"
    answered = ray.data.from_items(rows).map_batches(
        killed_replica.DiesOnceAfterAnswering, fn_constructor_kwargs={"marker": str(marker), **kwargs},
        batch_format="pyarrow", batch_size=6, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    out = sorted(answered.take_all(), key=lambda row: row["index"])
    assert marker.exists()  # a replica did die holding answers
    assert [row["index"] for row in out] == list(range(len(rows)))  # each row once
    assert [(row["text"], list(row["token_ids"]), row["error"]) for row in out] == \
        [(row["text"], row["token_ids"], None) for row in expected]


@pytest.mark.ray
def test_serve_with_2_replicas_answers_the_openai_client_from_both(tiny_llama_dir, ray_address, tmp_path):
    from qrun.llm import LLM
    from qrun.sampling_params import SamplingParams

    openai = pytest.importorskip("openai")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen([sys.executable, "-m", "qrun.cli", "serve", str(tiny_llama_dir), "--port", str(port),
                               "--replicas", "2", "--ray-address", ray_address, "--served-model-name", "tiny",
                               *ENGINE_FLAGS], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        # Logged once every replica is up; /health answers as soon as one is.
        while f"serving {tiny_llama_dir} on {url} with 2 replicas" not in log_path.read_text():
            assert server.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        assert request(url, "/health")[0] == 200
        offline = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        sync = client(url)
        completion = sync.completions.create(model="tiny", prompt="hello there", max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert completion.choices[0].text == offline.generate("hello there", greedy, progress=False)[0].text
        messages = [{"role": "user", "content": "hi"}]
        chat = sync.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
        expected = offline.generate(offline.tokenizer.encode_chat(messages), greedy, progress=False)[0]
        assert chat.choices[0].message.content == expected.text

        async def one(c: "openai.AsyncOpenAI", i: int) -> str:
            raw = await c.completions.with_raw_response.create(model="tiny", prompt=f"request {i}", max_tokens=8,
                                                               temperature=0)
            assert raw.parse().choices[0].text is not None
            return raw.headers["x-qrun-replica"]

        async def many() -> list[str]:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
                return await asyncio.gather(*(one(c, i) for i in range(16)))

        spread = Counter(asyncio.run(many()))
        assert len(spread) == 2, spread
        answered = _requests_answered_by_replica(url, set(spread))
        assert sum(answered.values()) == 18 and all(answered[r] >= spread[r] for r in spread), (answered, spread)
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=120)
        log.close()
    assert code == 0, log_path.read_text()[-3000:]


def _without_cached(record: dict) -> dict:
    return {name: value for name, value in record.items() if name != "cached_tokens"}


def _requests_answered_by_replica(url: str, replicas: set[str]) -> dict[str, int]:
    """Each replica's qrun_http_requests_total{status="200"}: /metrics as many times as it takes
    for the proxy to route it to every replica."""
    answered: dict[str, int] = {}
    for _ in range(100):
        _, headers, body = request(url, "/metrics")
        match = re.search(r'^qrun_http_requests_total\{status="200"\} (\d+)$', body["text"], re.M)
        answered[headers["x-qrun-replica"]] = int(match.group(1)) if match else 0
        if set(answered) >= replicas:
            return answered
    raise AssertionError(f"/metrics came only from {sorted(answered)}")
