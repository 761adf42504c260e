"""Decode steps replayed from CUDA graphs: the eager tokens, whatever the batch's padding.

Without a GPU the graph's replay is the captured step run again over the same static buffers
(what a replay does), so the buffers, the padding and the bucket choice are checked on any
machine; the capture itself is checked where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from qrun import LLM, SamplingParams
from qrun.cuda_graphs import CudaGraphDecode, batch_buckets

GREEDY = dict(temperature=0, ignore_eos=True)


def prompts_and_params(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of different lengths whose requests end at different steps, so the decode batch
    shrinks through sizes that pad to a larger bucket."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=3 + 4 * i, **GREEDY) for i in range(n)]


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, progress=False)]


def test_buckets_cover_every_batch_size_with_little_padding():
    for max_num_seqs in (1, 3, 16, 64, 100):
        buckets = batch_buckets(max_num_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs
        for n in range(1, max_num_seqs + 1):
            assert next(b for b in buckets if b >= n) - n < 16
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_replayed_decode_steps_generate_the_eager_tokens(tiny_llama_dir, monkeypatch, kv_cache_dtype):
    monkeypatch.setenv("QRUN_KERNELS", "torch")
    options = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=4_000_000, max_num_seqs=12,
                   enforce_eager=True)
    prompts, params = prompts_and_params(7)
    expected = token_ids(LLM(str(tiny_llama_dir), **options), prompts, params)

    llm = LLM(str(tiny_llama_dir), **options)
    runner = llm.engine.runner
    graphs = runner.graphs = CudaGraphDecode(runner.model, runner.kv_cache, 12, llm.engine.max_model_len)
    batches = []
    monkeypatch.setattr(graphs, "_capture", lambda bucket: lambda: graphs._forward(bucket))
    hidden_states = graphs.hidden_states
    monkeypatch.setattr(graphs, "hidden_states",
                        lambda ids, *rest: batches.append(len(ids)) or hidden_states(ids, *rest))
    assert token_ids(llm, prompts, params) == expected
    assert set(graphs.replays) == {1, 2, 4, 8} and {3, 5, 7} <= set(batches)  # padded batches ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager_on_the_gpu(tiny_llama_dir):
    options = dict(dtype="float32", kv_cache_memory=8_000_000, max_num_seqs=12, device="cuda")
    prompts, params = prompts_and_params(7)
    expected = token_ids(LLM(str(tiny_llama_dir), enforce_eager=True, **options), prompts, params)
    llm = LLM(str(tiny_llama_dir), enforce_eager=False, **options)
    assert token_ids(llm, prompts, params) == expected
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.enabled and set(graphs.replays) == {1, 2, 4, 8}
