"""GPTQ and round-to-nearest on single matrices."""

import pytest
import torch

from qrun.convert.gptq import (Candidate, HessianAccumulator, QuantizationError, drift_corrected, drift_error,
                               gptq_quantize, output_error, rtn_quantize)
from qrun.kernels.dequant_matmul import dequant_matmul_ref


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return acc.hessian()


def correlated_inputs(k: int, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    scale = torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]  # a few loud channels
    latent = torch.randn(tokens, k, generator=g)
    return (latent @ mix + 0.3 * latent) * scale


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_rtn_on_output_error_with_correlated_inputs(bits):
    torch.manual_seed(0)
    x = correlated_inputs(256, 2048)
    w = torch.randn(128, 256)
    h = hessian_of(x)
    cand = Candidate(64, ((bits, 1.0),))
    gptq_err = output_error(w, gptq_quantize(w, h, cand).dequantized(), h)
    rtn_err = output_error(w, rtn_quantize(w, cand).dequantized(), h)
    assert gptq_err < 0.7 * rtn_err
    y = x @ w.T  # the Hessian error is the real output error
    direct = ((x @ gptq_quantize(w, h, cand).dequantized().T - y).pow(2).sum() / y.pow(2).sum()).item()
    assert direct == pytest.approx(gptq_err, rel=1e-3)


def test_drift_corrected_target_matches_full_precision_outputs_from_drifted_inputs():
    x_fp = correlated_inputs(128, 4096, seed=2)
    x_q = x_fp + 0.2 * correlated_inputs(128, 4096, seed=3)  # what quantized layers upstream deliver
    w = torch.randn(32, 128)
    h = x_q.T @ x_q / x_q.shape[0]
    corrected = drift_corrected(w, h, (x_fp - x_q).T @ x_q / x_q.shape[0], damp=1e-6)
    y = x_fp @ w.T
    best = torch.linalg.lstsq(x_q, y).solution.T  # argmin ||x_q V^T - x_fp W^T||
    assert (x_q @ corrected.T - y).norm() == pytest.approx((x_q @ best.T - y).norm().item(), rel=1e-4)
    assert (x_q @ corrected.T - y).norm() < 0.7 * (x_q @ w.T - y).norm()
    # drift_error is the same objective up to a constant, so it ranks candidates the same way
    cross, const = (x_fp - x_q).T @ x_q / 4096, (y.pow(2).sum() / 4096).item()
    for v in (corrected, w):
        direct = ((x_q @ v.T - y).pow(2).sum() / 4096).item()
        assert drift_error(w, v, h, cross) + const == pytest.approx(direct, rel=1e-3)
    # nothing drifted: the target is the weights themselves, exactly, whatever the damping
    assert torch.equal(drift_corrected(w, h, torch.zeros(128, 128), damp=0.01), w)


def test_inverse_factor_is_the_upper_cholesky_factor_of_the_damped_inverse_hessian():
    from qrun.convert.gptq import _inverse_factor

    x = correlated_inputs(96, 512, seed=4).double()
    h = x.T @ x / 512
    u = _inverse_factor(h, damp=0.01)
    assert torch.equal(u, u.triu()) and (u.diag() > 0).all()
    damped = h + 0.01 * h.diag().mean() * torch.eye(96, dtype=h.dtype)
    assert torch.allclose(u.T @ u, torch.linalg.inv(damped), rtol=1e-8, atol=1e-10)


def test_more_bits_for_important_groups_lowers_error_at_equal_storage():
    x = correlated_inputs(256, 2048, seed=1)
    w = torch.randn(64, 256)
    h = hessian_of(x)
    uniform = gptq_quantize(w, h, Candidate(32, ((3, 1.0),)))
    mixed = gptq_quantize(w, h, Candidate(32, ((4, 0.25), (3, 0.5), (2, 0.25))))
    assert mixed.layout.group_bits == (4, 4, 3, 3, 3, 3, 2, 2)
    assert mixed.layout.storage_bits() == uniform.layout.storage_bits()
    assert output_error(w, mixed.dequantized(), h) < output_error(w, uniform.dequantized(), h)


def relative_weight_error(w_hat: torch.Tensor, w: torch.Tensor) -> float:
    return float((w_hat - w).square().sum() / w.square().sum())


def test_weights_on_a_q4_1_grid_are_reproduced_to_code_precision_by_4bit_g32_asym():
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(96, 4, generator=g) * 0.02 + 0.001).half().float()
    m = (-torch.rand(96, 4, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (96, 4, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 blocks span their min and max
    w = (q * d[..., None] + m[..., None]).reshape(96, 128)
    x = correlated_inputs(128, 512)
    acc = HessianAccumulator(128)
    acc.add(x)
    three_bit = relative_weight_error(rtn_quantize(w, Candidate(32, ((3, 1.0),), asym=True)).dequantized(), w)
    for order in (False, "group"):  # group act-order moves whole blocks: the grid stays intact
        result = gptq_quantize(w, acc.hessian(), Candidate(32, ((4, 1.0),), asym=True, act_order=order))
        # Only the 8-bit scale and min codes round: far below a bit less per weight.
        assert relative_weight_error(result.dequantized(), w) < three_bit / 20
        assert result.layout.bpw() < 5.0  # a float16 scale and min per group alone would be 5.0
    column_order = gptq_quantize(w, acc.hessian(), Candidate(32, ((4, 1.0),), asym=True))
    assert relative_weight_error(column_order.dequantized(), w) > three_bit / 10


def test_packed_tensors_reproduce_the_quantized_matrix():
    x = correlated_inputs(192, 512, seed=2)
    w = torch.randn(48, 192)
    acc = HessianAccumulator(192)
    acc.add(x)
    result = gptq_quantize(w, acc.hessian(), Candidate(64, ((8, 0.34), (5, 0.33), (2, 0.33)), asym=True))
    t = result.tensors()
    y = dequant_matmul_ref(x, t["qweight"], t["qgroups"], t["scales"], t["scale_max"], t.get("mins"),
                           t.get("min_absmax"), t["perm"], 64)
    torch.testing.assert_close(y, x @ result.dequantized().T, rtol=1e-4, atol=1e-3)


def test_group_size_snaps_to_a_divisor_of_the_input_size():
    assert Candidate(128, ((4, 1.0),)).layout(576, 8).group_size == 96
    assert Candidate(256, ((4, 1.0),)).layout(576, 8).group_size == 192
    assert Candidate(128, ((4, 1.0),)).layout(1536, 8).group_size == 128
    assert Candidate(64, ((4, 1.0),)).layout(96, 8).group_size == 32
    with pytest.raises(QuantizationError):
        Candidate(128, ((4, 1.0),)).layout(100, 8)


def test_no_calibration_tokens_is_an_error():
    with pytest.raises(QuantizationError):
        HessianAccumulator(8).hessian()


def test_candidates_quantized_together_equal_quantized_alone():
    from qrun.convert.gptq import gptq_quantize_many

    x = correlated_inputs(128, 512, seed=4)
    w = torch.randn(40, 128)
    h = hessian_of(x)
    cands = [Candidate(64, ((2, 1.0),)), Candidate(64, ((8, 0.5), (3, 0.5))), Candidate(32, ((4, 1.0),), asym=True),
             Candidate(32, ((4, 0.5), (3, 0.5)), asym=True, act_order="group"),
             Candidate(32, ((5, 1.0),), asym=True, act_order=False)]
    together = gptq_quantize_many(w, h, cands)
    for cand, result in zip(cands, together):
        alone = gptq_quantize(w, h, cand)
        assert result.layout == alone.layout
        torch.testing.assert_close(result.dequantized(), alone.dequantized(), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_smollm2_q4_1_weights_are_reproduced_to_code_precision_at_about_four_and_a_half_bits(smollm2_gguf):
    from qrun.gguf import open_gguf

    wanted = {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    found = {}
    for name, tensor in open_gguf(smollm2_gguf).tensors():
        if name in wanted:
            found[name] = tensor
        if len(found) == len(wanted):
            break
    for name, w in found.items():
        k = w.shape[1]
        result = rtn_quantize(w, Candidate(32, ((4, 1.0),), asym=True))
        assert relative_weight_error(result.dequantized(), w) < 3e-4, name  # 1e-4 measured
        # Codes plus two float16 ranges per output column and the qgroups; no perm.
        assert result.layout.bpw() == 4.5 + 32 / k + 2 / w.shape[0]


def test_optimizer_meets_the_budget_and_prefers_low_error():
    from qrun.convert.optimize import optimize

    def block(name, errors):
        return {"name": name, "weights": 1000,
                "results": [{"candidate": f"{b}b", "bits": b * 1000, "error": e, "kl": e} for b, e in errors]}

    sensitive = block("a", [(2, 1.0), (3, 0.3), (4, 0.1), (5, 0.0)])
    robust = block("b", [(2, 0.02), (3, 0.01), (4, 0.005), (5, 0.0)])
    picked, bpw = optimize([sensitive, robust], 3.5)
    assert picked == ["5b", "2b"] and bpw == 3.5  # bits go where they lower the KL most
    picked, bpw = optimize([sensitive, robust], 2.0)  # exactly the cheapest plan
    assert picked == ["2b", "2b"] and bpw == 2.0
    with pytest.raises(Exception, match="below the smallest"):
        optimize([sensitive, robust], 1.9)
