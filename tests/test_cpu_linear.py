"""Dense bfloat16 linears on the CPU: small batches through a float16 copy (falling back where it
overflows), larger ones through a prepacked weight with the plain linear's exact result; float32
ones (auto dtype without native bfloat16) with their weights rounded to float16."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qrun import cpu_linear
from qrun.cpu_linear import CpuDenseLinear, bfloat16_only, can_prepack, use_cpu_dense_linears
from qrun.kernels import cpu_library


def linear(k=64, n=48, bias=True):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    return lin, CpuDenseLinear(lin)


def test_one_row_matches_the_bfloat16_linear():
    lin, half = linear()
    x = torch.randn(1, 64).to(torch.bfloat16)
    got = half(x)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 48)
    exact = x.float() @ lin.weight.float().T + lin.bias.float()
    assert (got.float() - exact).abs().max() <= (lin(x).float() - exact).abs().max() + 0.02


def test_many_rows_use_the_bfloat16_weight_exactly():
    lin, half = linear()
    x = torch.randn(5, 64).to(torch.bfloat16)
    torch.testing.assert_close(half(x), lin(x), rtol=0, atol=0)


def test_bfloat16_only_runs_the_bfloat16_weight():
    lin, half = linear(bias=False)
    x = torch.randn(1, 64).to(torch.bfloat16)
    half.weight_f16.fill_(float("inf"))  # as if the float16 product overflowed
    assert not torch.isfinite(half(x)).all()
    with bfloat16_only(nn.Sequential(half)):
        torch.testing.assert_close(half(x), lin(x), rtol=0, atol=0)
    assert half.enabled


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_llama64_dir"])
def test_a_step_past_float16_range_reruns_in_bfloat16(checkpoint, request):
    """Heads of 16: the torch model's steps; of 64: decode steps in the C++ model, which reruns itself."""
    from qrun import LLM, SamplingParams

    llm = LLM(str(request.getfixturevalue(checkpoint)), dtype="bfloat16", device="cpu", kv_cache_memory=1 << 22)
    runner = llm.engine.runner
    assert (runner.cpu_model is not None) == (checkpoint == "tiny_llama64_dir" and cpu_library.available())
    if not runner.gemv_rows:
        pytest.skip("float16 GEMV does not apply on this CPU")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with bfloat16_only(runner.model):
        expected = llm.generate(["hi"], params, progress=False)[0].outputs[0].token_ids
    head_f16 = runner.model.lm_head.weight_f16.clone()
    runner.model.lm_head.weight_f16.fill_(float("inf"))  # the head alone overflows
    assert llm.generate(["hi"], params, progress=False)[0].outputs[0].token_ids == expected
    runner.model.lm_head.weight_f16.copy_(head_f16)
    for layer in runner.model.layers:  # as if every float16 product overflowed
        layer.mlp.down_proj.weight_f16.fill_(float("inf"))
    assert llm.generate(["hi"], params, progress=False)[0].outputs[0].token_ids == expected


def test_a_step_counts_as_finite_only_without_nan_or_infinity_anywhere():
    from qrun.model_runner import _all_finite

    hidden, logits = torch.randn(2, 8).to(torch.bfloat16), torch.randn(2, 50) * 1e30
    assert _all_finite(hidden, logits) and _all_finite(hidden, None)
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = logits.clone()
        spoiled[1, 17] = bad
        assert not _all_finite(hidden, spoiled)
        assert not _all_finite(spoiled.to(torch.bfloat16), None)


def test_every_dense_linear_is_swapped_keeping_a_shared_weight_as_it_is():
    torch.manual_seed(0)
    tied = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    own = nn.Linear(8, 4).to(torch.bfloat16)
    model = nn.Sequential(tied, nn.Sequential(own), nn.Linear(8, 8, bias=False).to(torch.bfloat16))
    model[2].weight = tied.weight  # as a head tied to the embedding
    plain = own.weight.detach().clone()
    use_cpu_dense_linears(model)
    assert all(isinstance(m, CpuDenseLinear) for m in (model[0], model[1][0], model[2]))
    assert model[0].weight is tied.weight and model[2].weight is tied.weight
    if can_prepack():  # the packed copy replaces a weight no other module reads
        assert model[1][0].weight.is_mkldnn and torch.equal(model[1][0].weight.to_dense(), plain)
    x = torch.randn(6, 8).to(torch.bfloat16)
    torch.testing.assert_close(model[1][0](x), F.linear(x, plain, own.bias), rtol=0, atol=0)


def test_float32_weights_are_rounded_to_float16_so_every_path_multiplies_the_same_values():
    torch.manual_seed(0)
    tied = nn.Embedding(50, 64)
    head = nn.Linear(64, 50, bias=False)
    head.weight = tied.weight
    model = nn.Sequential(nn.Linear(64, 48), head, nn.Linear(64, 8))
    model[2].weight.data[0, 0] = 7e4  # past float16's range: stays a float32 nn.Linear
    original = model[0].weight.detach().clone()
    use_cpu_dense_linears(model)
    assert isinstance(model[0], CpuDenseLinear) and isinstance(model[1], CpuDenseLinear)
    assert type(model[2]) is nn.Linear and model[2].weight[0, 0] == 7e4
    dense = model[0]
    assert dense.weight.dtype == torch.float32 and torch.equal(dense.weight, dense.weight_f16.float())
    assert torch.equal(dense.bias, dense.bias_f16.float()) and not torch.equal(dense.weight, original)
    assert model[1].weight is tied.weight and torch.equal(tied.weight, model[1].weight_f16.float())
    one, many = torch.randn(1, 64), torch.randn(12, 64)
    for x in (one, many):
        torch.testing.assert_close(dense(x), F.linear(x, dense.weight, dense.bias), rtol=1e-5, atol=1e-5)
    assert dense(one).dtype == torch.float32


@pytest.mark.parametrize("native_bfloat16, dtype, swapped", [(False, "auto", True), (False, "float32", False),
                                                              (True, "auto", True)])
def test_auto_dtype_without_native_bfloat16_runs_float32_with_float16_weights_and_cache(tiny_llama64_dir, monkeypatch,
                                                                                       native_bfloat16, dtype,
                                                                                       swapped):
    from qrun import LLM, SamplingParams, loader

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("CpuDenseLinears need torch's AVX2 or AVX-512 kernels")
    monkeypatch.setattr(loader, "cpu_has_native_bfloat16", lambda: native_bfloat16)
    llm = LLM(str(tiny_llama64_dir), dtype=dtype, device="cpu", kv_cache_memory=1 << 22)
    model = llm.engine.runner.model
    assert llm.engine.loaded.dtype == (torch.bfloat16 if native_bfloat16 else torch.float32)
    assert isinstance(model.lm_head, CpuDenseLinear) == swapped
    # the cache stores what the linears hold: float16 beside float32 ones held in float16
    cache_dtype = torch.bfloat16 if native_bfloat16 else torch.float16 if dtype == "auto" else torch.float32
    assert llm.engine.runner.kv_cache.k.dtype == cache_dtype
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate(["hi there", "a longer prompt than that"], params, progress=False)
    if swapped and not native_bfloat16:  # the same greedy tokens one at a time as batched
        for prompt, batched in zip(["hi there", "a longer prompt than that"], out):
            alone = llm.generate([prompt], params, progress=False)[0]
            assert alone.outputs[0].token_ids == batched.outputs[0].token_ids


def test_the_compiled_linear_equals_the_eager_one():
    _, dense = linear()
    compiled = torch.compile(dense.forward, dynamic=True)
    for rows in (3, 7):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), dense(x), rtol=0, atol=0)


@pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")
def test_measured_read_streams_reach_every_gemv_and_leave_its_products_alone(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32, bias=False)).to(torch.bfloat16)
    use_cpu_dense_linears(model)
    x = torch.randn(1, 64).to(torch.bfloat16)
    before = model(x)
    swept = []
    monkeypatch.setattr(cpu_linear, "fastest_for", lambda products: swept.extend(m(1) for m, _ in products) or 1)
    cpu_linear.measure_gemv_read_streams(model)
    assert len(swept) == 2 and [lin.read_streams for lin in model] == [1, 1]
    passed = []
    for lin in model:
        lin.half_gemv = lambda *args, multiply=lin.half_gemv: passed.append(args[-1]) or multiply(*args)
    assert torch.equal(model(x), before) and passed == [1, 1]
