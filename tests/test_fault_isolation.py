"""Fault isolation: a fault while processing one request fails that request alone; a failed forward
pass fails the requests of its step; either way their blocks go back and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from test_engine import GREEDY, llm, prompts  # noqa: F401 - llm is the tiny engine fixture

from qrun.errors import RequestFailed
from qrun.llm_engine import LLMEngine
from qrun.sampling_params import SamplingParams, StructuredOutputsParams
from qrun.sequence import Sequence
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


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_logits_row_fails_only_its_request(llm, value):
    def inject(patch, engine):
        execute = engine.runner.execute

        def faulty_execute(batch):
            logits, sampling = execute(batch)
            for row, seq in enumerate(sampling):
                if is_bad(seq) and len(seq.output_token_ids) == 1:
                    with torch.inference_mode():
                        logits[row, 7] = value
            return logits, sampling

        patch.setattr(engine.runner, "execute", faulty_execute)

    # n=2: its second completion forks off the first's blocks and must be freed too.
    expect_isolated(llm, inject, "NaN or infinite", bad=SamplingParams(max_tokens=12, n=2, **GREEDY))


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

