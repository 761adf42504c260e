"""QuantLinear: the CPU fast path agrees with the float32 reference on every layout it meets."""

import pytest
import torch
from torch import nn

from qrun.convert.gptq import Candidate, HessianAccumulator, gptq_quantize
from qrun import quant
from qrun.kernels import cpu_int4, cpu_quant_matmul
from qrun.quant import QuantLinear, matmul_path, prepare_quantized_linears


@pytest.fixture(params=["vnni", "int4pack"])
def int4_kernel(request, monkeypatch):
    """Each of CpuQuantMatmul's kernels in turn (the VNNI one where this CPU has it)."""
    if request.param == "vnni" and not cpu_quant_matmul.available():
        pytest.skip("no AVX512-VNNI kernel on this machine")
    if request.param == "int4pack":
        monkeypatch.setattr(cpu_quant_matmul, "available", lambda: False)
    return request.param


def quant_linear(cand: Candidate, k: int, n: int, bias: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(256, k, generator=g)
    acc = HessianAccumulator(k)
    acc.add(x)
    result = gptq_quantize(w, acc.hessian(), cand)
    module = QuantLinear(result.layout, bias=bias)
    for name, tensor in result.tensors().items():
        setattr(module, name, nn.Parameter(tensor.float() if tensor.is_floating_point() else tensor,
                                           requires_grad=False))
    if bias:
        module.bias = nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    return module, result


@pytest.mark.parametrize("cand,k,n", [
    (Candidate(64, ((4, 0.5), (3, 0.25), (2, 0.25))), 576, 192),  # all int4-representable
    (Candidate(32, ((4, 1.0),), asym=True, act_order=False), 576, 64),  # Q4_1-like, no perm stored
    (Candidate(128, ((4, 0.5), (3, 0.5))), 576, 64),  # group 96: int4 kernel at group 32, scales repeated
    (Candidate(128, ((8, 0.25), (6, 0.25), (4, 0.5))), 1536, 64),  # wide prefix: two 4-bit digits
    (Candidate(64, ((6, 1.0),)), 192, 32),  # all wide
    (Candidate(64, ((4, 1.0),)), 192, 40),  # N not a multiple of 16: dense fallback
    (Candidate(128, ((3, 1.0),), asym=True, act_order=False, rotate=True), 576, 64),  # rotated input
    (Candidate(64, ((4, 0.5), (3, 0.5)), rotate=True), 1536, 32),  # rotated, then permuted
])
@pytest.mark.parametrize("rows", [5, cpu_int4.DEQUANTIZE_ROWS + 3])  # int4pack: its kernel; dequantize-then-matmul
def test_fast_cpu_path_matches_reference(monkeypatch, int4_kernel, cand, k, n, rows):
    module, result = quant_linear(cand, k, n, bias=True)
    x = torch.randn(rows, k)
    monkeypatch.setenv("QRUN_QUANT_CPU", "ref")
    module.prepare()
    ref = module(x)
    torch.testing.assert_close(ref, x @ result.dequantized().T + module.bias, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("QRUN_QUANT_CPU", "fast")
    module.prepare()
    if module.cpu_matmul.dense is None:
        assert (module.cpu_matmul.planes is not None) == (int4_kernel == "vnni")
    fast = module(x)
    assert fast.dtype == x.dtype and fast.shape == (rows, n)
    rel = (fast - ref).norm() / ref.norm()
    assert rel < 2e-2  # int8 (vnni) or bfloat16 (int4pack) activations


@pytest.mark.skipif(not cpu_quant_matmul.available(), reason="no AVX512-VNNI kernel on this machine")
@pytest.mark.parametrize("bits, stored", [(2, (2, None)), (3, (3, None)), (4, (4, None)), (5, (4, 1)), (6, (4, 2)),
                                          (8, (4, 4))])
def test_cpu_planes_store_each_digit_in_the_bits_its_codes_need(bits, stored):
    """A 3-bit matrix is read as 3 bits a weight, a 6-bit one's upper digits as 2: not nibbles."""
    n, k = 64, 256
    module, _ = quant_linear(Candidate(128, ((bits, 1.0),), asym=True), k, n)
    module.prepare()
    planes = module.cpu_matmul.planes
    assert planes[0].numel() * 8 == n * k * stored[0]
    assert (planes[4] is None) == (stored[1] is None)
    if stored[1] is not None:
        assert planes[4].numel() * 8 == n * k * stored[1]


@pytest.mark.skipif(not cpu_int4.layout_is_known(), reason="no C++ kernels, or torch packs int4 differently")
@pytest.mark.parametrize("cand", [Candidate(64, ((4, 0.5), (3, 0.5))),
                                  Candidate(128, ((8, 0.25), (6, 0.25), (4, 0.5)))])  # wide codes: two digits
def test_many_rows_dequantize_and_agree_with_the_int4_kernel(monkeypatch, cand):
    monkeypatch.setattr(cpu_quant_matmul, "available", lambda: False)
    module, _ = quant_linear(cand, 1536, 128)
    module.prepare()
    x = torch.randn(cpu_int4.DEQUANTIZE_ROWS, 1536)
    assert module.cpu_matmul.dequantizes
    dequantized = module(x)
    module.cpu_matmul.dequantizes = False
    kernel = module(x)
    # the same weights, rounded to bfloat16 on the dequantized path (wide codes: each digit's
    # part, then their sum), and both outputs rounded to bfloat16: a few 2^-9 relative errors
    assert ((dequantized - kernel).norm() / kernel.norm()) < 1e-2


@pytest.mark.parametrize("rotate", [False, True])
def test_weight_reconstruction_in_original_order_and_basis(rotate):
    module, result = quant_linear(Candidate(64, ((5, 0.5), (3, 0.5)), asym=True, rotate=rotate), 256, 32)
    torch.testing.assert_close(module.dequantized_weight(), result.dequantized())


def test_unknown_cpu_mode_is_rejected(monkeypatch):
    module, _ = quant_linear(Candidate(64, ((4, 1.0),)), 128, 16)
    monkeypatch.setenv("QRUN_QUANT_CPU", "turbo")
    with pytest.raises(ValueError):
        module.prepare()


def quantized_siblings(cand: Candidate, k: int, widths: list[int]) -> list[QuantLinear]:
    """Linears quantized against one input's Hessian, as q/k/v are (so act order permutes them alike)."""
    g = torch.Generator().manual_seed(1)
    acc = HessianAccumulator(k)
    acc.add(torch.randn(256, k, generator=g) * torch.linspace(0.1, 3, k))
    modules = []
    for n in widths:
        result = gptq_quantize(torch.randn(n, k, generator=g) * 0.05, acc.hessian(), cand)
        module = QuantLinear(result.layout, bias=True)
        for name, tensor in result.tensors().items():
            setattr(module, name, nn.Parameter(tensor, requires_grad=False))
        module.bias = nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
        module.prepare()
        modules.append(module)
    return modules


@pytest.mark.parametrize("cand", [Candidate(64, ((4, 0.5), (3, 0.5))), Candidate(128, ((8, 0.25), (4, 0.75))),
                                  Candidate(32, ((4, 1.0),), asym=True, act_order=False)])
def test_fused_siblings_equal_each_linear_concatenated(cand):
    linears = quantized_siblings(cand, 256, [64, 32, 32])
    fused = QuantLinear.fuse(linears)
    assert fused is not None
    x = torch.randn(7, 256)
    torch.testing.assert_close(fused(x), torch.cat([lin(x) for lin in linears], -1), rtol=1e-2, atol=1e-2)


def test_linears_permuted_differently_are_not_fused():
    cand = Candidate(64, ((4, 1.0),))
    a = quantized_siblings(cand, 256, [32])[0]
    b = quant_linear(cand, 256, 32, seed=5)[0]
    b.prepare()
    assert not torch.equal(a.perm, b.perm)
    assert QuantLinear.fuse([a, b]) is None


def test_torch_backend_on_a_gpu_dequantizes_instead_of_using_the_cpu_only_int4_kernel(monkeypatch):
    from qrun.kernels import ops_for
    from qrun.kernels.dequant_matmul import dequant_matmul_ref, dequant_matmul_triton

    monkeypatch.setenv("QRUN_KERNELS", "torch")
    assert matmul_path(torch.device("cuda")) == "dequant_matmul"
    assert ops_for(torch.device("cuda")).dequant_matmul is dequant_matmul_ref
    assert matmul_path(torch.device("cpu")) == "cpu_int4"
    monkeypatch.setenv("QRUN_KERNELS", "auto")
    assert matmul_path(torch.device("cuda")) == "dequant_matmul"
    assert ops_for(torch.device("cuda")).dequant_matmul is dequant_matmul_triton
    assert matmul_path(torch.device("cpu")) == "cpu_int4"

    # A module whose weights sit where the CPU kernel does not exist (the device check faked):
    # nothing is built for the CPU at load, and its forward runs the table's torch reference.
    module, result = quant_linear(Candidate(64, ((4, 0.5), (3, 0.5))), 256, 32)
    monkeypatch.setenv("QRUN_KERNELS", "torch")
    monkeypatch.setattr(quant, "matmul_path", lambda device: "dequant_matmul")
    prepare_quantized_linears(module)
    assert module.cpu_matmul is None and module.dequant_matmul is dequant_matmul_ref
    x = torch.randn(3, 256)
    torch.testing.assert_close(module(x), x @ result.dequantized().T, rtol=1e-4, atol=1e-4)
    assert module.cpu_matmul is None



@pytest.mark.skipif(not cpu_quant_matmul.available(), reason="no AVX512-VNNI kernel on this machine")
def test_measured_read_streams_reach_every_vnni_matmul_and_leave_its_products_alone(monkeypatch):
    linears = quantized_siblings(Candidate(64, ((4, 0.5), (3, 0.5))), 256, [64, 32])
    x = torch.randn(1, 256)
    before = [lin(x) for lin in linears]
    swept = []
    monkeypatch.setattr(quant, "fastest_for", lambda products: swept.extend(m(1) for m, _ in products) or 1)
    quant.measure_read_streams(nn.ModuleList(linears))
    assert swept and [lin.cpu_matmul.read_streams for lin in linears] == [1, 1]
    multiply, passed = cpu_quant_matmul.quant_matmul, []
    monkeypatch.setattr(cpu_quant_matmul, "quant_matmul", lambda *args: passed.append(args[-1]) or multiply(*args))
    assert all(torch.equal(lin(x), product) for lin, product in zip(linears, before))
    assert passed == [1, 1]
