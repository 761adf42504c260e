"""Batching never changes greedy results on the real model and the real mixed workload."""

from __future__ import annotations

import pytest

from qrun import LLM, SamplingParams

pytestmark = pytest.mark.slow
NUM_REQUESTS = 32
MAX_TOKENS = 8
LLM_TOKENS: dict[str, list[int]] = {}  # prompt -> its token ids, filled by the sequential run


@pytest.fixture(scope="module")
def requests(workload):
    return [(r["prompt"], SamplingParams(max_tokens=min(r["max_tokens"], MAX_TOKENS), temperature=0, ignore_eos=True))
            for r in workload[:NUM_REQUESTS]]


@pytest.fixture(scope="module")
def sequential(smollm2_gguf, requests):
    """Each request alone, through an engine that has no prefix cache to lean on."""
    llm = LLM(str(smollm2_gguf), dtype="float32", enable_prefix_caching=False, kv_cache_memory=400_000_000)
    outputs = [llm.generate([prompt], params, progress=False)[0] for prompt, params in requests]
    LLM_TOKENS.update((prompt, o.prompt_token_ids) for (prompt, _), o in zip(requests, outputs))
    return [o.token_ids for o in outputs]


BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2's float32 K and V over its 30 layers
ENGINES = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "small-chunks": dict(max_num_batched_tokens=48, max_num_seqs=16),
    "preempting": None,  # a cache just larger than the longest request: preemption is certain
}


@pytest.mark.parametrize("variant", ENGINES)
def test_batched_greedy_equals_sequential_on_smollm2(smollm2_gguf, requests, sequential, variant):
    args = dict(dtype="float32", kv_cache_memory=400_000_000)
    if variant == "preempting":
        longest = max(len(ids) for ids in sequential) + max(len(LLM_TOKENS[p]) for p, _ in requests)
        args["kv_cache_memory"] = (longest + 64) * BYTES_PER_TOKEN
    else:
        args |= ENGINES[variant]
    llm = LLM(str(smollm2_gguf), **args)
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], progress=False)
    assert [o.token_ids for o in outputs] == sequential
    engine = llm.engine
    if variant == "preempting":
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def smol_llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory=100_000_000)


@pytest.fixture(scope="module")
def hf_smol(smollm2_gguf):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


def test_generate_answers_a_factual_prompt(smol_llm):
    out = smol_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0),
                            progress=False)[0]
    assert "Paris" in out.text


@pytest.mark.parametrize("prompt", [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
])
def test_32_greedy_tokens_equal_transformers(smol_llm, hf_smol, prompt):
    import torch

    ours = smol_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), progress=False)[0]
    # Plain argmax decoding with transformers' KV cache: no generation-config defaults (EOS
    # suppression, stopping) can differ from ignore_eos.
    ids = torch.tensor([ours.prompt_token_ids])
    ref, past = [], None
    with torch.no_grad():
        for _ in range(32):
            out = hf_smol(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
            ref.append(int(ids))
    assert ours.token_ids == ref
