"""Fault isolation: a fault while processing one request fails that request alone; a failed forward
pass fails the requests of its step; either way their blocks go back and the engine keeps serving.
The engine loop of AsyncLLM never dies silently, and the server reports every failure in OpenAI's
error shape."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest
import torch

from test_engine import GREEDY, llm, prompts  # noqa: F401 - llm is the tiny engine fixture
from test_server import ENGINE_ARGS, MODEL, live_server, request, wait_idle

from qrun import LLM
from qrun.async_llm import AsyncLLM
from qrun.errors import EngineStopped, RequestFailed
from qrun.llm_engine import LLMEngine
from qrun.sampling_params import SamplingParams, StructuredOutputsParams
from qrun.sequence import Sequence
from qrun.server import build_app
from qrun.structured_outputs import Matcher
from qrun.tokenizer import IncrementalDetokenizer

# The request every injected fault hits: byte tokens random prompts (prompts()) never start with.
BAD_PROMPT = [251, 252, 253, 254, 255, 250]
PARAMS = SamplingParams(max_tokens=12, stop=["\x00never\x00"], **GREEDY)  # a stop string, so it is checked
GOOD = prompts(4, seed=5)


def is_bad(seq: Sequence) -> bool:
    return seq.prompt_token_ids == BAD_PROMPT


def injected(*args, **kwargs):
    raise RuntimeError("injected fault")


def assert_engine_clean(engine: LLMEngine) -> None:
    """No request left, every block free, no prefix block referenced."""
    blocks = engine.block_manager
    assert not engine.requests and not engine.has_unfinished_requests()
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(block.ref_count == 0 for block in blocks.blocks)


def expect_isolated(llm, inject, match: str, bad: SamplingParams = PARAMS,
                    good: list[SamplingParams] | None = None) -> None:
    """Run GOOD with BAD_PROMPT among them while `inject(monkeypatch, engine)` is in force: the bad
    request ends with finish_reason "error" and a message matching `match`, the engine is clean,
    and the good requests' outputs equal those of a run without the fault made afterwards."""
    good = good or [PARAMS] * len(GOOD)
    batch = [GOOD[0], BAD_PROMPT, *GOOD[1:]]
    params = [good[0], bad, *good[1:]]
    with pytest.MonkeyPatch.context() as patch:
        inject(patch, llm.engine)
        faulty = llm.generate(batch, params, progress=False)
    failed = faulty.pop(1)
    assert failed.finished and failed.finish_reason == "error", failed
    assert failed.error is not None and match in failed.error
    assert_engine_clean(llm.engine)
    clean = llm.generate(batch, params, progress=False)  # the engine still serves
    assert clean.pop(1).finish_reason != "error"
    assert [(o.token_ids, o.text, o.finish_reason, o.error) for o in faulty] == \
           [(o.token_ids, o.text, o.finish_reason, None) for o in clean]
    assert_engine_clean(llm.engine)


# -- one request's fault ------------------------------------------------------------------------
def test_a_detokenizer_fault_fails_only_its_request(llm):
    add = IncrementalDetokenizer.add

    def faulty_add(self, token_id):
        if self.ids[:4] == BAD_PROMPT[-4:]:  # the detokenizer keeps its prompt's last 4 ids
            raise RuntimeError("injected fault")
        return add(self, token_id)

    expect_isolated(llm, lambda patch, engine: patch.setattr(IncrementalDetokenizer, "add", faulty_add),
                    "injected fault")


def test_a_stop_string_check_fault_fails_only_its_request(llm):
    cut = LLMEngine._cut_stop_string

    def faulty_cut(seq, previous_len):
        return injected() if is_bad(seq) and len(seq.output_token_ids) == 3 else cut(seq, previous_len)

    expect_isolated(llm, lambda patch, engine: patch.setattr(LLMEngine, "_cut_stop_string",
                                                             staticmethod(faulty_cut)), "injected fault")


def test_a_sampler_fault_fails_only_its_request_and_seeded_neighbours_draw_as_before(llm):
    from qrun import sampler

    bad = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    logprobs = sampler._logprobs

    def faulty_logprobs(logits, params, tokens):  # after penalties and the seeded draws
        return injected() if any(p is bad for p in params) else logprobs(logits, params, tokens)

    # The good rows are resampled one by one from the batch's logits: their penalties must not
    # apply twice, nor their seeded generators draw twice.
    good = [SamplingParams(max_tokens=12, temperature=0.9, seed=i, repetition_penalty=1.3, min_tokens=4)
            for i in range(len(GOOD))]
    expect_isolated(llm, lambda patch, engine: patch.setattr(sampler, "_logprobs", faulty_logprobs),
                    "sampling failed", bad=bad, good=good)


def test_sample_leaves_the_logits_it_is_given_unchanged(llm):
    # What makes resampling a failed batch's rows one at a time exact.
    from qrun.sampler import sample

    params = SamplingParams(max_tokens=8, temperature=0.9, seed=1, repetition_penalty=1.3, presence_penalty=0.5,
                            min_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    seq = Sequence(0, "r", 0, [1, 2, 3], params, detokenizer=None, arrival_time=0.0, output_token_ids=[4, 5],
                   generator=torch.Generator().manual_seed(1),
                   matcher=llm.engine.grammar_compiler.matcher(params.structured_outputs))
    bitmask = llm.engine.grammar_compiler.bitmask(1)
    seq.matcher.fill_bitmask(bitmask, 0)
    logits = torch.randn(1, llm.engine.loaded.config.vocab_size)
    given = logits.clone()
    sample(logits, [seq], llm.engine.eos_token_ids, bitmask)
    assert torch.equal(logits, given)


@pytest.fixture(scope="module")
def cpp_decode_llm(tiny_llama64_dir):
    """An engine whose decode steps run the C++ model, which reports each row's finiteness itself,
    one step at a time (runs of steps: test_a_non_finite_row_in_a_run_of_decode_steps_...)."""
    llm = LLM(str(tiny_llama64_dir), dtype="float32", kv_cache_memory=8_000_000, max_num_seqs=16,
              num_scheduler_steps=1)
    if llm.engine.runner.cpu_model is None:
        pytest.skip("the C++ model is not built here")
    return llm


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("engine_fixture", ["llm", "cpp_decode_llm"])
def test_a_non_finite_logits_row_fails_only_its_request(request, engine_fixture, value):
    llm = request.getfixturevalue(engine_fixture)
    reported = []

    def inject(patch, engine):
        execute = engine.runner.execute

        def faulty_execute(batch):
            logits, sampling, first_max = execute(batch)
            reported.append(first_max is not None)
            for row, seq in enumerate(sampling):
                if is_bad(seq) and len(seq.output_token_ids) == 1:
                    if first_max is not None:  # the C++ step's report of such a row (test_cpu_model pins it)
                        first_max[row] = -1
                    else:
                        with torch.inference_mode():
                            logits[row, 7] = value
            return logits, sampling, first_max

        patch.setattr(engine.runner, "execute", faulty_execute)

    # n=2: its second completion forks off the first's blocks and must be freed too.
    expect_isolated(llm, inject, "NaN or infinite", bad=SamplingParams(max_tokens=12, n=2, **GREEDY))
    assert any(reported) == (engine_fixture == "cpp_decode_llm")


def test_a_non_finite_row_in_a_run_of_decode_steps_fails_only_its_request(tiny_llama64_dir):
    llm = LLM(str(tiny_llama64_dir), dtype="float32", kv_cache_memory=8_000_000, max_num_seqs=16)
    if llm.engine.runner.cpu_model is None:
        pytest.skip("the C++ model is not built here")
    runs = []

    def inject(patch, engine):
        decode = engine.runner.decode

        def faulty_decode(batch, stop_token_ids):
            decoded, logprobs = decode(batch, stop_token_ids)
            runs.append(len(decoded))
            bad = [row for row, seq in enumerate(batch.seqs) if is_bad(seq)]
            if bad and len(decoded) > 2:  # as the C++ model reports it: the run ends with that step
                for row in bad:
                    decoded[1][row] = -1
                return decoded[:2], logprobs[:2]
            return decoded, logprobs

        patch.setattr(engine.runner, "decode", faulty_decode)

    expect_isolated(llm, inject, "NaN or infinite", bad=SamplingParams(max_tokens=12, n=2, **GREEDY))
    assert runs


@pytest.mark.parametrize("method", ["fill_bitmask", "advance"])
def test_a_grammar_matcher_fault_fails_only_its_request(llm, method):
    # Only the bad request has a grammar, so every matcher call is its own.
    constrained = SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{20}"),
                                 **GREEDY)
    expect_isolated(llm, lambda patch, engine: patch.setattr(Matcher, method, injected), "injected fault",
                    bad=constrained)


# -- a failed forward pass ----------------------------------------------------------------------
def test_a_failed_forward_pass_fails_its_steps_requests_and_the_engine_serves_on(llm):
    engine = llm.engine
    batch = [BAD_PROMPT, *GOOD]
    clean = llm.generate(batch, PARAMS, progress=False)
    execute = engine.runner.execute

    def faulty_execute(scheduled):  # mid-decode, once prefixes are cached and blocks filled
        if any(is_bad(seq) and len(seq.output_token_ids) == 3 for seq in scheduled.seqs):
            raise RuntimeError("injected fault")
        return execute(scheduled)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.runner, "execute", faulty_execute)
        patch.setattr(engine.scheduler, "max_num_seqs", 2)  # the step holds BAD_PROMPT and GOOD[0] only
        faulty = llm.generate(batch, PARAMS, progress=False)
    for failed in faulty[:2]:
        assert failed.finish_reason == "error" and "forward pass" in failed.error
        assert len(failed.token_ids) == 3  # what it had before the failed step
    assert [o.token_ids for o in faulty[2:]] == [o.token_ids for o in clean[2:]]
    assert_engine_clean(engine)
    assert [o.token_ids for o in llm.generate(batch, PARAMS, progress=False)] == [o.token_ids for o in clean]


def test_a_step_that_raises_leaves_no_request_of_generate_behind(llm, monkeypatch):
    # A fault outside any one request (here the scheduler's) reaches the caller, whose requests
    # are then aborted: nothing keeps running or holding blocks for an answer nobody awaits.
    monkeypatch.setattr(llm.engine.scheduler, "schedule", injected)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(GOOD, PARAMS, progress=False)
    monkeypatch.undo()
    assert_engine_clean(llm.engine)


def test_stream_raises_when_its_request_fails(llm, monkeypatch):
    monkeypatch.setattr(IncrementalDetokenizer, "add", injected)
    with pytest.raises(RequestFailed, match="injected fault"):
        list(llm.stream(BAD_PROMPT, PARAMS))
    monkeypatch.undo()
    assert_engine_clean(llm.engine)


# -- the AsyncLLM engine loop -------------------------------------------------------------------
@pytest.fixture
def async_llm(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


async def _final(engine: AsyncLLM, prompt, params=PARAMS):
    """The last output of one request, or the exception it raised, within 20 s (never a hang)."""
    async def run():
        output = None
        async for output in engine.generate(prompt, params):
            pass
        return output

    try:
        return await asyncio.wait_for(run(), 20)
    except (EngineStopped, TimeoutError) as err:
        return err


def test_async_llm_reports_a_request_failure_as_its_output_and_serves_on(async_llm, monkeypatch):
    monkeypatch.setattr(IncrementalDetokenizer, "add", injected)
    failed = asyncio.run(_final(async_llm, BAD_PROMPT))
    assert failed.finish_reason == "error" and "injected fault" in failed.error
    monkeypatch.undo()
    assert asyncio.run(_final(async_llm, BAD_PROMPT)).finish_reason == "length"


def test_a_request_cancelled_while_queued_for_the_engine_does_not_stop_it(async_llm, monkeypatch):
    # A client that leaves before the engine thread takes its request: the command's future is
    # cancelled by then, and answering it must not kill the thread.
    gate = threading.Event()
    add = async_llm.engine.add_request

    def held_add(*args):  # the first add holds the engine thread until the gate opens
        gate.wait(10)
        return add(*args)

    monkeypatch.setattr(async_llm.engine, "add_request", held_add)

    async def main():
        first = asyncio.create_task(_final(async_llm, GOOD[0]))
        queued = asyncio.create_task(_final(async_llm, GOOD[1]))
        await asyncio.sleep(0.2)
        queued.cancel()
        await asyncio.sleep(0.1)
        gate.set()
        return await first

    assert asyncio.run(main()).finish_reason == "length"
    assert asyncio.run(_final(async_llm, GOOD[2])).finish_reason == "length"
    assert_engine_clean(async_llm.engine)


def test_a_dead_engine_loop_fails_waiting_and_new_requests_instead_of_hanging(async_llm, monkeypatch):
    # Anything the loop itself calls may fail: here the statistics it reads between steps.
    monkeypatch.setattr(async_llm.engine, "stats", injected)
    failed = asyncio.run(_final(async_llm, GOOD[0]))
    assert isinstance(failed, EngineStopped) and "injected fault" in str(failed)
    assert async_llm.stopped_reason is not None and "injected fault" in async_llm.stopped_reason
    assert isinstance(asyncio.run(_final(async_llm, GOOD[1])), EngineStopped)


def test_a_request_after_shutdown_fails_instead_of_hanging(async_llm):
    async_llm.shutdown()
    failed = asyncio.run(_final(async_llm, GOOD[0]))
    assert isinstance(failed, EngineStopped) and "shut down" in str(failed)


def test_a_stream_whose_event_loop_closed_is_aborted_and_the_engine_serves_on(async_llm):
    loop = asyncio.new_event_loop()
    abandoned = async_llm.generate(BAD_PROMPT, SamplingParams(max_tokens=200, **GREEDY))
    loop.run_until_complete(abandoned.__anext__())
    loop.close()  # its consumer never closes the stream: the engine must not keep delivering to it
    assert asyncio.run(_final(async_llm, GOOD[0])).finish_reason == "length"
    asyncio.run(_final(async_llm, GOOD[1]))  # the abort runs on the engine thread between steps
    assert_engine_clean(async_llm.engine)
    del abandoned


# -- the server ---------------------------------------------------------------------------------
@pytest.fixture
def served(async_llm):
    with live_server(build_app(async_llm, model_name=MODEL)) as base:
        yield base, async_llm.engine


def _fail_forward_at(engine: LLMEngine, patch: pytest.MonkeyPatch, produced: int) -> None:
    """Fail every forward pass that would give a sequence its token number `produced` + 1."""
    execute = engine.runner.execute

    def faulty_execute(batch):
        if any(len(seq.output_token_ids) == produced for seq in batch.seqs):
            raise RuntimeError("injected fault")
        return execute(batch)

    patch.setattr(engine.runner, "execute", faulty_execute)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
])
def test_a_request_the_engine_fails_is_a_500_in_openai_shape(served, monkeypatch, path, body):
    url, engine = served
    _fail_forward_at(engine, monkeypatch, 0)
    status, _, reply = request(url, path, body)
    assert status == 500, reply
    assert reply["error"]["type"] == "server_error" and "forward pass" in reply["error"]["message"]
    assert reply["error"]["code"] == 500
    monkeypatch.undo()
    wait_idle(url)
    assert_engine_clean(engine)
    assert request(url, path, body)[0] == 200


def test_a_stream_the_engine_fails_ends_with_an_error_event(served, monkeypatch):
    url, engine = served
    _fail_forward_at(engine, monkeypatch, 3)
    conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 8, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [line.removeprefix(b"data: ").decode() for line in resp.read().splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "forward pass" in error["message"]
    monkeypatch.undo()
    wait_idle(url)
    assert_engine_clean(engine)


def test_an_engine_step_failure_is_a_500_even_when_it_is_a_value_error(served, monkeypatch):
    # ValueError is what the engine raises for a request it refuses (a 400); one raised by a
    # failing step is the server's fault.
    url, engine = served

    def schedule():
        raise ValueError("injected fault")

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    status, _, reply = request(url, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 500 and reply["error"]["type"] == "server_error", reply
    monkeypatch.undo()
    assert request(url, "/v1/completions", {"prompt": "x", "max_tokens": 4})[0] == 200


def test_health_and_new_requests_are_503_once_the_engine_loop_died(served, monkeypatch):
    url, engine = served
    assert request(url, "/health")[0] == 200
    monkeypatch.setattr(engine, "stats", injected)
    status, _, reply = request(url, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status in (500, 503) and reply["error"]["type"] == "server_error", reply
    status, _, reply = request(url, "/health")
    assert status == 503 and "injected fault" in reply["error"]["message"]
    status, _, reply = request(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and reply["error"]["type"] == "server_error"
    assert "injected fault" in reply["error"]["message"]

