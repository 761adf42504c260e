"""Quantized KV caches: capacity from the byte arithmetic, and every engine feature (batching,
chunked prefill, prefix caching, copy-on-write, preemption) unchanged within one cache dtype."""

from __future__ import annotations

import pytest
import torch

from qrun import LLM, SamplingParams
from qrun.kernels import ops_for
from hypothesis import given, settings, strategies as st

from qrun.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref
from qrun.kernels.rotation import random_signs, reflect, rotate, rotation_factors
from qrun.kv_cache import KVCache, KVCacheSpec, KeyCalibration

GREEDY = dict(temperature=0, ignore_eos=True)
BUDGET = 1_500_000


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_llm(request, tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=request.param, kv_cache_memory=BUDGET,
               max_num_batched_tokens=64, max_num_seqs=16)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8", "int4"])
def test_cache_holds_what_its_bytes_per_token_say(tiny_llama_dir, name):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=name, kv_cache_memory=BUDGET, max_num_seqs=64)
    engine = llm.engine
    tokens = engine.block_manager.num_blocks * engine.config.block_size
    per_token = engine.cache_spec.bytes_per_token(engine.loaded.config)
    assert tokens == pytest.approx(BUDGET / per_token, rel=0.05)
    allocated = sum(t.numel() * t.element_size() for t in engine.runner.kv_cache.tensors())
    assert allocated == tokens * per_token  # scales included in the arithmetic


@pytest.mark.parametrize("head_dim", [64, 128])
def test_quantized_caches_hold_about_two_and_three_times_the_tokens(head_dim):
    from qrun.config import ModelConfig

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32 * head_dim,
                                  "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "vocab_size": 1000, "max_position_embeddings": 4096})
    sixteen = KVCacheSpec(torch.bfloat16).bytes_per_token(config)
    assert sixteen / KVCacheSpec(torch.float32, 8).bytes_per_token(config) == pytest.approx(1.88, abs=0.01)
    assert sixteen / KVCacheSpec(torch.float32, 4).bytes_per_token(config) == pytest.approx(3.2, abs=0.01)


def test_unknown_cache_dtype_names_the_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not one of auto, float32, .*int4"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="fp8")


def test_rotation_is_orthogonal_so_scores_are_unchanged(tiny_llama_dir):
    config = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=BUDGET).engine.loaded.config
    cache = KVCache(config, 2, 16, KVCacheSpec(torch.float32, 4), "cpu")
    ops = ops_for(torch.device("cpu"))
    signs, factors = cache.rotation_signs, cache.rotation_factors
    eye = torch.eye(config.head_dim)
    rotation = ops.rotate(eye, signs, factors)
    assert (rotation.abs() > 0.5 / config.head_dim ** 0.5).all()  # every channel spread over all of them
    torch.testing.assert_close(rotation @ rotation.T, eye, atol=1e-6, rtol=0)
    torch.testing.assert_close(ops.unrotate(rotation, signs, factors), eye, atol=1e-6, rtol=0)
    q, k = torch.randn(5, config.head_dim), torch.randn(7, config.head_dim)
    rotated_q, rotated_k = ops.rotate(q, signs, factors), ops.rotate(k, signs, factors)
    torch.testing.assert_close(rotated_q @ rotated_k.T, q @ k.T, atol=1e-5, rtol=1e-5)
    assert KVCache(config, 2, 16, KVCacheSpec(torch.float32, 4, rotate=False), "cpu").rotation_signs is None


def _queries_keys(seed: int, heads: int, kv_heads: int, dim: int, spread: float):
    """Queries and keys whose channels' sizes differ by up to e^spread, independently of each other."""
    g = torch.Generator().manual_seed(seed)
    scales = [(torch.rand(h, dim, generator=g) * spread).exp() for h in (heads, kv_heads)]
    return [torch.randn(512, h, dim, generator=g) * s for h, s in zip((heads, kv_heads), scales)]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 3]),
       dim=st.sampled_from([32, 64]))
def test_key_calibration_leaves_every_score_product_exactly_unchanged(seed, kv_heads, group, dim):
    queries, keys = _queries_keys(seed, kv_heads * group, kv_heads, dim, spread=6.0)
    calibration = KeyCalibration.measure(queries, keys + 3.0)
    balance = calibration.balance
    assert torch.equal(balance, torch.exp2(balance.log2().round()))  # powers of two: exact in every dtype
    q_balance = balance.reciprocal().repeat_interleave(group, 0)
    centred = keys + 3.0 - calibration.mean
    by_head = centred.repeat_interleave(group, 1)
    balanced = by_head * balance.repeat_interleave(group, 0)
    assert torch.equal((queries * q_balance) * balanced, queries * by_head)  # each product, so each sum


@pytest.mark.parametrize("seed", range(4))
def test_key_calibration_shrinks_the_score_error_of_an_int4_key(seed):
    queries, keys = _queries_keys(seed, 4, 2, 64, spread=4.0)
    calibration = KeyCalibration.measure(queries, keys)
    q_balance = calibration.balance.reciprocal().repeat_interleave(2, 0)

    def score_error(q, k):
        dequantized = dequantize_kv_ref(*quantize_kv_ref(k, 4, 32), torch.float32)
        by_head = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
        return ((q * by_head(dequantized - k)).sum(-1)).pow(2).mean()

    centred = keys - calibration.mean
    assert score_error(queries * q_balance, centred * calibration.balance) < 0.8 * score_error(queries, centred)


@pytest.mark.parametrize("dim", [64, 96])  # a power of two, and 3 x 32 (the rotation's Hartley factor)
def test_key_calibration_reflects_the_first_key_onto_what_the_rotation_makes_constant(dim):
    """The first key (an attention sink), centred and balanced, reflected and rotated, has every element equal:
    a shift that each quantization group's zero absorbs. The reflection is orthogonal: scores stay."""
    queries, keys = _queries_keys(5, 6, 2, dim, spread=2.0)
    keys[0] += 20 * torch.randn(2, dim, generator=torch.Generator().manual_seed(1))  # far from the mean
    calibration = KeyCalibration.measure(queries, keys)
    signs, factors = random_signs(dim, 7), rotation_factors(dim, torch.device("cpu"))
    first = (keys[:1] - calibration.mean) * calibration.balance
    image = rotate(reflect(first, calibration.reflection), signs, factors)
    spread = image.amax(-1) - image.amin(-1)
    assert (spread < 1e-4 * image.abs().amax(-1)).all() and (image.abs().amax(-1) > 1).all()
    unreflected = rotate(first, signs, factors)
    assert ((unreflected.amax(-1) - unreflected.amin(-1)) > 1).all()  # without it: far from constant


def test_quantized_cache_batched_and_chunked_greedy_equals_sequential(quantized_llm):
    batch = prompts(10, seed=1)
    params = [SamplingParams(max_tokens=4 + 2 * i, **GREEDY) for i in range(10)]
    together = quantized_llm.generate(batch, params, progress=False)  # 64-token budget: prompts arrive in chunks
    for prompt, p, out in zip(batch, params, together):
        assert out.token_ids == quantized_llm.generate([prompt], p, progress=False)[0].token_ids


def test_quantized_cache_serves_a_repeated_prompt_from_its_prefix_cache(quantized_llm):
    prompt = list(range(3, 103))
    first = quantized_llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY), progress=False)[0]
    second = quantized_llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY), progress=False)[0]
    assert second.metrics.num_cached_tokens == 96
    assert first.token_ids == second.token_ids


def test_quantized_cache_n_completions_copy_on_write(quantized_llm):
    prompt = prompts(1, seed=4)[0] + list(range(20))
    one = quantized_llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY), progress=False)[0]
    many = quantized_llm.generate([prompt], SamplingParams(n=3, max_tokens=10, **GREEDY), progress=False)[0]
    assert all(c.token_ids == one.token_ids for c in many.outputs)
    manager = quantized_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_quantized_cache_preempts_and_still_matches_sequential(tiny_llama_dir, quantized_llm):
    name = quantized_llm.engine.config.kv_cache_dtype
    small = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=name, kv_cache_memory=60_000,
                max_num_seqs=8, max_num_batched_tokens=64)
    batch = prompts(8, seed=3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    outs = small.generate(batch, params, progress=False)
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.token_ids == quantized_llm.generate([prompt], params, progress=False)[0].token_ids
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


def test_quantized_cache_logits_stay_close_to_the_float_cache(tiny_llama_dir):
    from qrun.perplexity import window_logprobs

    loaded = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=BUDGET).engine.loaded
    ids = torch.tensor(prompts(1, seed=5)[0] * 3)[:200]
    reference = window_logprobs(loaded.model, ids)
    for name, most in (("int8", 1e-3), ("int4", 2e-2)):
        logp = window_logprobs(loaded.model, ids, name)
        kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()
        assert 0 < kl < most, (name, kl)


def test_quantized_cache_is_refused_on_gpus_before_ampere(monkeypatch):
    from qrun.errors import QrunError
    from qrun.kv_cache import _check_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(QrunError, match="needs an Ampere or newer GPU.*sm_75"):
        _check_device(KVCacheSpec(torch.float16, 8), torch.device("cuda"))
    _check_device(KVCacheSpec(torch.float16), torch.device("cuda"))  # a float cache runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    _check_device(KVCacheSpec(torch.float16, 4), torch.device("cuda"))
