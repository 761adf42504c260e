"""The engine end to end: batching never changes results, sampling and stopping behave."""

from __future__ import annotations

import gc

import pytest
import torch

from qrun import LLM, SamplingParams
from qrun.errors import RequestError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8_000_000, max_num_batched_tokens=128,
               max_num_seqs=16)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_batched_greedy_equals_sequential_on_tiny_model(llm):
    batch = prompts(12)
    params = [SamplingParams(max_tokens=5 + 3 * i, **GREEDY) for i in range(12)]
    together = llm.generate(batch, params, progress=False)
    for prompt, p, out in zip(batch, params, together):
        alone = llm.generate([prompt], p, progress=False)[0]
        assert out.token_ids == alone.token_ids
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens


def test_generate_writes_nothing_to_a_piped_stdout_or_stderr(llm, capfd):
    llm.generate(prompts(2), SamplingParams(max_tokens=3))
    assert capfd.readouterr() == ("", "")


def test_outputs_come_back_in_input_order(llm):
    batch = prompts(6, seed=1)
    outs = llm.generate(batch, [SamplingParams(max_tokens=12 - 2 * i, **GREEDY) for i in range(6)], progress=False)
    assert [o.prompt_token_ids for o in outs] == batch
    assert [len(o.token_ids) for o in outs] == [12 - 2 * i for i in range(6)]


def test_seeded_sampling_is_independent_of_batch_composition(llm):
    target = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params, progress=False)[0].token_ids
    crowd = prompts(7, seed=6)
    mixed = llm.generate(crowd[:3] + [target] + crowd[3:],
                         [SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True)] * 3 + [params]
                         + [SamplingParams(max_tokens=30, temperature=1.2, ignore_eos=True)] * 4, progress=False)
    assert mixed[3].token_ids == alone


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
    outs = llm.generate([[1, 2, 3]] * 4, params, progress=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_n_completions_share_the_prompt_blocks(llm):
    prompt = prompts(1, seed=9)[0] + list(range(40))
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
                       progress=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_greedy_n_completions_are_identical_to_n_equals_one(llm):
    prompt = prompts(1, seed=10)[0]
    one = llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY), progress=False)[0]
    many = llm.generate([prompt], SamplingParams(n=3, max_tokens=12, **GREEDY), progress=False)[0]
    assert all(c.token_ids == one.token_ids for c in many.outputs)


def test_a_step_for_final_outputs_reports_each_request_once_as_it_finishes(llm):
    engine = llm.engine
    for i, prompt in enumerate(prompts(3, seed=7)):
        engine.add_request(f"final-{i}", prompt, SamplingParams(max_tokens=2 + 3 * i, **GREEDY))
    reported = []
    while engine.has_unfinished_requests():
        reported += [(out.request_id, out.finished, len(out.token_ids)) for out in engine.step(finished_only=True)]
    assert reported == [("final-0", True, 2), ("final-1", True, 5), ("final-2", True, 8)]
    assert not any(request_id.startswith("final-") for request_id in engine.requests)


def test_step_observers_see_every_token_the_engine_computes(llm):
    batch = prompts(3, seed=99)  # prompts no other test cached
    seen = []
    llm.engine.step_observers.append(seen.append)
    try:
        llm.generate(batch, SamplingParams(max_tokens=4, **GREEDY), progress=False)
    finally:
        llm.engine.step_observers.remove(seen.append)
    prompt_tokens = sum(map(len, batch))
    assert sum(step.prefill_tokens for step in seen) == prompt_tokens
    assert sum(step.scheduled_tokens for step in seen) == prompt_tokens + 3 * (4 - 1)
    assert seen[-1].num_running == 0 and seen[-1].live_tokens == 0
    block_size = llm.engine.block_manager.block_size
    assert all(step.live_tokens <= step.partial_blocks * block_size <= step.used_blocks * block_size
               for step in seen)


def test_prefix_cache_serves_a_repeated_prompt(llm):
    prompt = list(range(100))
    first = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), progress=False)[0]
    second = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), progress=False)[0]
    assert second.metrics.num_cached_tokens == 96  # six full blocks; the last token is recomputed
    assert first.token_ids == second.token_ids


def test_stop_string_is_cut_even_when_split_across_tokens(llm):
    base = llm.generate([[65, 66, 67]], SamplingParams(max_tokens=30, **GREEDY), progress=False)[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]  # three single-byte tokens: the stop string spans several tokens
    out = llm.generate([[65, 66, 67]], SamplingParams(max_tokens=30, stop=[stop], **GREEDY), progress=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    kept = llm.generate([[65, 66, 67]], SamplingParams(max_tokens=30, stop=stop, include_stop_str_in_output=True,
                                                       **GREEDY), progress=False)[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_stream_never_shows_a_stop_string(llm):
    base = llm.generate([[70, 71]], SamplingParams(max_tokens=30, **GREEDY), progress=False)[0].text
    stop = base[5:8]
    deltas = list(llm.stream([70, 71], SamplingParams(max_tokens=30, stop=[stop], **GREEDY)))
    assert "".join(deltas) == base[: base.find(stop)]
    assert len(deltas) > 1


def test_stream_equals_generate(llm):
    params = SamplingParams(max_tokens=25, **GREEDY)
    assert "".join(llm.stream([5, 6, 7], params)) == llm.generate([[5, 6, 7]], params, progress=False)[0].text


def test_abandoned_stream_frees_its_blocks(llm):
    stream = llm.stream(list(range(50)), SamplingParams(max_tokens=100, **GREEDY))
    next(stream)
    assert llm.engine.block_manager.num_free_blocks < llm.engine.block_manager.num_blocks
    stream.close()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_eos_stops_unless_ignored(llm, monkeypatch):
    greedy = llm.generate([[1, 2]], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0].token_ids
    monkeypatch.setattr(llm.engine, "eos_token_ids", [greedy[2]])
    stopped = llm.generate([[1, 2]], SamplingParams(max_tokens=20, temperature=0), progress=False)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy[:3]
    assert stopped.stop_reason is None  # EOS is no stop reason, as in vLLM
    ignored = llm.generate([[1, 2]], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == greedy and ignored.stop_reason is None
    assert ignored.outputs[0].cumulative_logprob is None  # no logprobs asked for


def test_stop_token_ids_stop_generation(llm):
    greedy = llm.generate([[1, 2]], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0].token_ids
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=20, stop_token_ids=[greedy[4]], **GREEDY),
                       progress=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(greedy[4]) + 1]
    assert out.stop_reason == greedy[4]


def test_min_tokens_holds_back_stop_tokens(llm):
    first = llm.generate([[9, 9]], SamplingParams(max_tokens=1, **GREEDY), progress=False)[0].token_ids[0]
    out = llm.generate([[9, 9]], SamplingParams(max_tokens=8, min_tokens=5, temperature=0, stop_token_ids=[first]),
                       progress=False)[0]
    assert len(out.token_ids) >= 5 and first not in out.token_ids[:5]


def test_logit_bias_bans_and_forces_tokens_in_batches_and_alone(tiny_llama64_dir):
    # heads of 64: the C++ model decodes this one, in runs of steps where every sequence samples there
    llm = LLM(str(tiny_llama64_dir), dtype="float32", kv_cache_memory=8_000_000, device="cpu")
    params = SamplingParams(max_tokens=6, **GREEDY)
    greedy = llm.generate([[1, 2]], params, progress=False)[0].token_ids
    banned = SamplingParams(max_tokens=6, logit_bias={str(greedy[0]): -100}, **GREEDY)  # a JSON object's key
    forced = SamplingParams(max_tokens=6, logit_bias={7: 100}, logprobs=1, **GREEDY)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={7: 100})
    # the biased requests step beside free ones that decode in runs
    outs = llm.generate([[1, 2], [1, 2], [1, 2], [1, 2]], [banned, forced, params, sampled], progress=False)
    assert outs[0].token_ids[0] != greedy[0] and greedy[0] not in outs[0].token_ids
    assert outs[1].token_ids == [7] * 6 and outs[3].token_ids == [7] * 6
    assert outs[2].token_ids == greedy
    alone = llm.generate([[1, 2]], banned, progress=False)[0]
    assert alone.token_ids == outs[0].token_ids
    with pytest.raises(RequestError, match="logit_bias token id 100000 is outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={100_000: 1}), progress=False)


def test_logprobs_report_the_sampled_token_and_top_k(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, logprobs=3, **GREEDY), progress=False)[0]
    assert len(out.logprobs) == 6
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))
    assert out.outputs[0].cumulative_logprob < 0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert max(entry.values()) == entry[token] <= 0


def test_repetition_penalty_discourages_repeats(llm):
    plain = llm.generate([[40] * 30], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0].token_ids
    penalised = llm.generate([[40] * 30], SamplingParams(max_tokens=20, repetition_penalty=5.0, **GREEDY),
                             progress=False)[0].token_ids
    assert len(set(penalised)) >= len(set(plain))
    assert 40 not in penalised


def test_frequency_penalty_prevents_any_repeat_when_large(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=40, frequency_penalty=2.0, presence_penalty=2.0,
                                                   **GREEDY), progress=False)[0].token_ids
    assert len(set(out)) >= 30


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("min_tokens", 99),
    ("logprobs", 21), ("n", 0), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", "x"),
    ("logit_bias", {"x": 1}), ("logit_bias", {5: 101}), ("logit_bias", {5: float("nan")}), ("logit_bias", [5]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_prompt_longer_than_context_is_rejected_at_add(llm):
    with pytest.raises(RequestError, match="exceeds the model's context"):
        llm.generate([list(range(200)) * 3], SamplingParams(max_tokens=10), progress=False)
    assert not llm.engine.has_unfinished_requests()


def test_request_larger_than_the_cache_is_rejected_at_add(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=200_000, max_num_seqs=4,
                max_num_batched_tokens=64)
    capacity = small.engine.block_manager.num_blocks * 16
    with pytest.raises(RequestError, match="can never fit the KV cache"):
        small.generate([[7] * capacity], SamplingParams(max_tokens=20), progress=False)


def test_tiny_cache_preempts_and_still_matches_sequential(tiny_llama_dir, llm):
    small = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=200_000, max_num_seqs=8,
                max_num_batched_tokens=64)
    batch = prompts(8, seed=3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    outs = small.generate(batch, params, progress=False)
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.token_ids == llm.generate([prompt], params, progress=False)[0].token_ids
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


def test_empty_prompt_is_rejected(llm):
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], progress=False)


def test_prompts_in_vllms_dict_forms_equal_text_and_ids(llm):
    params = SamplingParams(max_tokens=4, **GREEDY)
    ids = llm.tokenizer.encode("Hello there")
    as_text, as_ids = llm.generate(["Hello there", ids], params, progress=False)
    dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": tuple(ids)}], params, progress=False)
    assert [o.token_ids for o in dicts] == [as_text.token_ids, as_ids.token_ids]
    one = llm.generate({"prompt_token_ids": ids}, params, progress=False)  # one prompt, not its keys
    assert len(one) == 1 and one[0].prompt_token_ids == ids and one[0].token_ids == as_ids.token_ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "hi", "multi_modal_data": {}}, "a prompt dict takes one key"),
    ({"text": "hi"}, "a prompt dict takes one key"),
    ([1.5, 2], "a prompt is text, a list of token ids"),
    (b"hi", "a prompt is text, a list of token ids"),
    ({"prompt_token_ids": ["a"]}, "a prompt is text, a list of token ids"),
])
def test_a_prompt_of_another_form_is_a_clear_error(llm, prompt, message):
    with pytest.raises(RequestError, match=f"^{message}"):
        llm.generate(prompt, progress=False)
    assert not llm.engine.has_unfinished_requests()


def test_out_of_vocabulary_token_is_rejected(llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 10_000]], progress=False)


def test_kv_cache_too_small_for_one_block_is_a_clear_error(tiny_llama_dir):
    from qrun.errors import QrunError

    with pytest.raises(QrunError, match="out of cache memory"):
        LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=100)


def test_a_new_engine_has_paid_for_collecting_what_loading_made(tiny_llama_dir):
    """Python's full collection of the objects loading made runs at load, not inside a later request's step."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8_000_000)
    younger_collections = gc.get_count()[1:]  # the collections since the last full one, by generation
    del llm
    assert younger_collections == (0, 0)
