"""Each Triton kernel against its torch reference, on fresh random inputs.

Where it runs:
- On a machine with CUDA (and TRITON_INTERPRET unset) the kernels are compiled and run on the
  GPU: the same cases become a real correctness check.
- Everywhere else they run under Triton's CPU interpreter (TRITON_INTERPRET=1).

Why the interpreter needs care here: Triton reads TRITON_INTERPRET whenever a `@triton.jit`
decorator *runs*. That happens for our kernels when their modules are imported, and for
Triton's own jit'd library functions (`tl.cdiv`, `tl.sum`, `tl.max`, ...) when `triton` itself is
first imported. pytest imports every test module before running any test, so if an earlier
module (anything importing `qrun.model` or `qrun.kernels`) imported triton without the variable,
those library functions are compiled-mode JITFunctions for the rest of the process and no
interpreted kernel that calls them can run -- reloading our own kernel modules is not enough,
and reloading triton's would be far more invasive. So this module:
1. sets TRITON_INTERPRET=1 (CPU only) before its imports and leaves it set (see below);
2. checks that Triton's library and our four kernels really are `InterpretedFunction`s;
3. if they are, runs every case in this process (per-case pass/fail in pytest's report);
   if not, skips those cases and `test_cases_in_fresh_interpreter_process` runs this same file in
   a child pytest with TRITON_INTERPRET=1 set from the start, failing with the child's report.
The fallback costs one extra interpreter start-up (~5 s) and never touches other modules' state.

Tolerances (elementwise, `torch.testing.assert_close` rtol = atol), against a float32 reference
computed from the very same (already rounded) inputs:
- float32: 1e-5 (attention: 2e-5; exact fp32 products, only summation order differs);
- float16: 2e-3 (~2 ulp: attention rounds P to fp16 for the P@V product, and the output);
- bfloat16: 1.6e-2 (~2 ulp). Two interpreter defects force this and the bf16 handling below:
  its float32->bfloat16 cast truncates instead of rounding to nearest even (so results can be a
  full ulp off where the GPU is within half an ulp), and `tl.dot` on bf16 operands returns
  garbage, so under the interpreter the attention wrapper casts bf16 tiles to fp32 before
  tl.dot (DOT_F32); on a GPU bf16 goes to the tensor cores as is.
Copies (store_kv without a dtype change) must be bit-exact.

Output buffers are filled with NaN before each call, and every cache slot a kernel must not
read (unreferenced pool blocks, slots past a sequence's end in its last block) holds NaN, so an
unwritten output element or a stray read fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

if not ON_GPU:
    # Left set for the rest of the process: Triton also reads it at call time (the first launch
    # lazily imports triton.experimental.gluon, which asserts interpreter mode for interpreted
    # library functions), and without a GPU no compiled-mode kernel could run anyway.
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402

import qrun.kernels as kernels  # noqa: E402
import qrun.kernels.cache_ops as cache_ops  # noqa: E402
import qrun.kernels.dequant_matmul as dm  # noqa: E402
import qrun.kernels.kv_quant as kv_quant  # noqa: E402
import qrun.kernels.norm as norm  # noqa: E402
import qrun.kernels.paged_attention as pa  # noqa: E402
from qrun.kernels.launch import sm_count  # noqa: E402
import qrun.kernels.rotary as rotary  # noqa: E402


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


IN_PROCESS = ON_GPU or all(_interpreted(fn) for fn in (
    tl.standard.cdiv, tl.standard.sum, pa._paged_attn_kernel, pa._merge_splits_kernel,
    cache_ops._store_kv_kernel, norm._rms_norm_kernel, rotary._rotary_kernel,
    dm._dq_gemv_kernel, dm._dq_mm_kernel,
))
_SKIP_REASON = ("triton was imported by an earlier test module without TRITON_INTERPRET=1, so its "
                "library functions cannot be interpreted in this process; these cases run in "
                "test_cases_in_fresh_interpreter_process instead")


@pytest.fixture(autouse=True)
def _cases_need_working_kernels(request):
    if not IN_PROCESS and request.node.originalname != "test_cases_in_fresh_interpreter_process":
        pytest.skip(_SKIP_REASON)


@pytest.mark.skipif(IN_PROCESS, reason="cases run in this process")
def test_cases_in_fresh_interpreter_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"child pytest failed:\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATTN_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- attention


def _attention_batch(specs, num_kv_heads, qpk, head_dim, block_size, dtype, seed, strided_q=False):
    """specs: (cached tokens before this step, new tokens) per sequence.

    Returns (args for the kernel with NaN in every slot it must not read, the same args with
    those slots zeroed and everything in float32 for the reference).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in specs]
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5  # a few blocks nobody owns
    pool = torch.randperm(num_blocks, generator=gen)  # scattered block tables
    block_tables = torch.full((len(specs), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = pool[used:used + count].to(torch.int32)
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, length in enumerate(seq_lens):
        for pos in range(length):
            readable[block_tables[s, pos // block_size], pos % block_size] = True
    query_lens = [new for _, new in specs]
    num_tokens, num_q_heads = sum(query_lens), num_kv_heads * qpk
    if strided_q:  # q as a slice of a wider projection output, as a fused QKV would give
        q = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)[:, :num_q_heads]
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = (block_tables, torch.tensor(seq_lens, dtype=torch.int32), starts, max(query_lens), max(seq_lens),
            head_dim ** -0.5)

    def poisoned(cache, fill):
        return cache.masked_fill(~readable[:, :, None, None], fill)

    dev = [t.to(DEVICE) for t in (q, poisoned(k_cache, float("nan")), poisoned(v_cache, float("nan")), *meta[:3])]
    ref = [t.float() for t in (q, poisoned(k_cache, 0.0), poisoned(v_cache, 0.0))] + list(meta[:3])
    return (*dev, *meta[3:]), (*ref, *meta[3:])


def _check_attention(specs, num_kv_heads, qpk, head_dim, block_size, dtype, seed=0, use_out=True, strided_q=False):
    args, ref_args = _attention_batch(specs, num_kv_heads, qpk, head_dim, block_size, dtype, seed, strided_q)
    expected = pa.paged_attention_ref(*ref_args)
    if use_out:
        out = torch.full(args[0].shape, float("nan"), dtype=dtype, device=DEVICE)
        got = pa.paged_attention_triton(*args, out=out)
        assert got is out
    else:
        got = pa.paged_attention_triton(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    _close(got.cpu(), expected, ATTN_TOL[dtype])


BS = 16
# Context lengths 1, block_size - 1, block_size, block_size + 1 and 300, all decoding.
DECODE_EDGES = [(0, 1), (BS - 2, 1), (BS - 1, 1), (BS, 1), (299, 1)]


@pytest.mark.parametrize("qpk", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_decode_edges(qpk, dtype):
    _check_attention(DECODE_EDGES, num_kv_heads=2, qpk=qpk, head_dim=64, block_size=BS, dtype=dtype, seed=qpk)


@pytest.mark.parametrize("qpk", [1, 3, 7])
def test_attention_prefill_edges(qpk):
    # Fresh prompts of 1, bs-1, bs, bs+1 and 70 tokens (several query blocks each).
    specs = [(0, 1), (0, BS - 1), (0, BS), (0, BS + 1), (0, 70)]
    _check_attention(specs, num_kv_heads=1, qpk=qpk, head_dim=64, block_size=BS, dtype=torch.float16, seed=10 + qpk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prefix_cached_prefill(dtype):
    # Query chunks after cached tokens: block-aligned and not, short and long chunks.
    specs = [(BS, 5), (37, 23), (100, 1 + 2 * BS), (250, 50)]
    _check_attention(specs, num_kv_heads=2, qpk=3, head_dim=64, block_size=BS, dtype=dtype, seed=20)


@pytest.mark.parametrize("head_dim, block_size, qpk", [(128, 16, 7), (128, 32, 1), (64, 128, 3), (32, 64, 2)])
def test_attention_mixed_batch(head_dim, block_size, qpk):
    # Decodes and prefills of every kind in one call; block sizes below and above the key tile.
    specs = [(299, 1), (0, 19), (3, 1), (block_size, 1), (40, 33), (block_size - 1, 1), (130, 7)]
    _check_attention(specs, num_kv_heads=2, qpk=qpk, head_dim=head_dim, block_size=block_size,
                     dtype=torch.float16, seed=30 + head_dim + block_size)


def test_attention_non_power_of_two_head_dim_and_strided_q():
    specs = [(0, 9), (50, 1), (17, 4)]
    _check_attention(specs, num_kv_heads=2, qpk=3, head_dim=80, block_size=BS, dtype=torch.float32, seed=40,
                     strided_q=True)


def test_attention_decode_group_out_of_length_order():
    # One batched decode group whose rows are not sorted by length (the longest in the middle).
    _check_attention([(27, 1), (29, 1), (28, 1)], num_kv_heads=2, qpk=3, head_dim=64, block_size=BS,
                     dtype=torch.float32, seed=42)
    _check_attention([(27, 1), (29, 1), (0, 5), (28, 1)], num_kv_heads=2, qpk=3, head_dim=64, block_size=BS,
                     dtype=torch.float32, seed=43)


def test_attention_allocates_out_when_none():
    _check_attention([(5, 3), (20, 1)], num_kv_heads=1, qpk=1, head_dim=64, block_size=BS,
                     dtype=torch.float32, seed=41, use_out=False)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("qpk", [1, 7])
def test_attention_split_k_forced(monkeypatch, splits, qpk):
    # Split-K on everything, including prefill chunks (causal rows with empty splits) and
    # contexts shorter than one split (splits with no tiles at all).
    monkeypatch.setattr(pa, "num_kv_splits", lambda *heuristic_inputs: splits)
    specs = [(299, 1), (0, 1), (60, 20), (BS, 1), (200, 3)]
    _check_attention(specs, num_kv_heads=1, qpk=qpk, head_dim=64, block_size=BS, dtype=torch.float16,
                     seed=50 + splits + qpk)


def test_attention_split_k_heuristic():
    # One long decode with few heads: the heuristic must choose split-K by itself.
    sms = sm_count(torch.device("cpu") if not ON_GPU else DEVICE)
    programs = (1 // 1 + 1) * 1
    assert pa.num_kv_splits(programs, 700, 64, sms) > 1
    assert pa.num_kv_splits(10_000, 700, 64, sms) == 1  # a full GPU never splits
    assert pa.num_kv_splits(programs, 64, 64, sms) == 1  # nor does a short context
    _check_attention([(699, 1)], num_kv_heads=1, qpk=3, head_dim=64, block_size=32, dtype=torch.bfloat16, seed=60)


# ----------------------------------------------------------------------------- quantized cache


def _quantized(cache: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_quant.quantize_kv_ref(cache, bits, kv_quant.kv_group_size(cache.shape[-1], bits))


def _check_quantized_attention(specs, bits, head_dim, qpk=3, dtype=torch.float16, seed=0):
    """Attention over a quantized cache: the reference equals attention over the dequantized
    values (so quantization is all it adds), and the kernel matches the reference. Scales of
    slots no sequence owns are NaN for the kernel, which must not read them."""
    args, ref_args = _attention_batch(specs, 2, qpk, head_dim, BS, torch.float32, seed)
    q, k_float, v_float = ref_args[:3]
    (k_data, k_scales), (v_data, v_scales) = _quantized(k_float, bits), _quantized(v_float, bits)
    meta = ref_args[3:]
    dequantized = [kv_quant.dequantize_kv_ref(d, s, torch.float32) for d, s in ((k_data, k_scales), (v_data, v_scales))]
    expected = pa.paged_attention_ref(q, *dequantized, *meta)
    got_ref = pa.paged_attention_ref(q, k_data, v_data, *meta, k_scales=k_scales, v_scales=v_scales)
    torch.testing.assert_close(got_ref, expected, rtol=1e-6, atol=1e-6)
    unread = torch.isnan(args[1].float()).any(-1).any(-1).cpu()  # [blocks, block_size]
    poisoned = [s.masked_fill(unread[:, :, None, None, None], float("nan")) for s in (k_scales, v_scales)]
    got = pa.paged_attention_triton(q.to(dtype).to(DEVICE), k_data.to(DEVICE), v_data.to(DEVICE),
                                    *[t.to(DEVICE) for t in meta[:3]], *meta[3:],
                                    k_scales=poisoned[0].to(DEVICE), v_scales=poisoned[1].to(DEVICE))
    _close(got.cpu(), expected, ATTN_TOL[dtype])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_quantized_attention_decode_prefill_and_prefix(bits, head_dim):
    specs = [(299, 1), (0, 19), (BS - 1, 1), (40, 33), (BS, 1)]
    _check_quantized_attention(specs, bits, head_dim, seed=80 + bits + head_dim)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_attention_split_k(monkeypatch, bits):
    monkeypatch.setattr(pa, "num_kv_splits", lambda *heuristic_inputs: 4)
    _check_quantized_attention([(299, 1), (60, 20), (0, 1)], bits, 64, qpk=7, dtype=torch.bfloat16, seed=90 + bits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_quantized_store_kv_matches_reference_bit_for_bit(bits, head_dim):
    gen = torch.Generator().manual_seed(100 + bits + head_dim)
    num_blocks, block_size, heads, tokens = 5, 16, 3, 29
    qkv = (torch.randn(tokens, heads * 3, head_dim, generator=gen) * 4).to(torch.float16)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]  # strided, as split from a fused QKV
    k[0, 0] = 1.5  # a group of equal values: the smallest step, not a division by zero
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    group = kv_quant.kv_group_size(head_dim, bits)

    def empty_cache():
        data = torch.zeros(num_blocks, block_size, heads, head_dim * bits // 8, dtype=kv_quant.storage_dtype(bits))
        return data, data.clone(), *[torch.zeros(num_blocks, block_size, heads, head_dim // group, 2,
                                                 dtype=kv_quant.SCALE_DTYPE) for _ in range(2)]

    expected, got = empty_cache(), [t.to(DEVICE) for t in empty_cache()]
    cache_ops.store_kv_ref(k, v, *expected[:2], slots, *expected[2:])
    cache_ops.store_kv_triton(k.to(DEVICE), v.to(DEVICE), *got[:2], slots.to(DEVICE), *got[2:])
    for g, e in zip(got, expected):
        if ON_GPU:  # the GPU divides approximately: a value may land one step over
            g = g.cpu()
            if g.dtype != kv_quant.SCALE_DTYPE and bits == 4:  # a step in a byte's high half is 16
                g, e = (torch.stack([t & 15, t >> 4], -1) for t in (g, e))
            assert (g.float() - e.float()).abs().max() <= (1 if g.dtype != kv_quant.SCALE_DTYPE else 1e-3)
        else:
            assert torch.equal(g.cpu(), e)
    k_back = kv_quant.dequantize_kv_ref(expected[0].view(-1, heads, head_dim * bits // 8)[slots],
                                        expected[2].view(-1, heads, head_dim // group, 2)[slots], torch.float32)
    groups = k.float().unflatten(-1, (-1, group))
    step = (groups.amax(-1) - groups.amin(-1)) / 15 if bits == 4 else groups.abs().amax(-1) / 127
    # half a step of rounding, plus the float16 rounding of the scale over up to 127 steps
    assert ((k_back - k.float()).abs().unflatten(-1, (-1, group)).amax(-1) <= step * 0.6 + 1e-3).all()


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("src_dtype, cache_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
])
def test_store_kv(src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(70)
    num_blocks, block_size, heads, dim, tokens = 7, 16, 3, 40, 29
    qkv = torch.randn(tokens, heads * 3, dim, generator=gen).to(src_dtype)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]  # strided, as split from a fused QKV
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    cache_ops.store_kv_ref(k, v, expected_k, expected_v, slots)
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    cache_ops.store_kv_triton(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), expected_k) and torch.equal(got_v.cpu(), expected_v)


def test_store_kv_skips_negative_slots():
    k = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(cache)
    cache_ops.store_kv_triton(k, k, cache, v_cache, torch.tensor([5, -1, 17], device=DEVICE))
    flat = cache.view(-1, 2, 16)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[17], k[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("shape", [(7, 77), (2, 3, 576)])
@pytest.mark.parametrize("dtype, weight_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape, dtype, weight_dtype, with_residual):
    gen = torch.Generator().manual_seed(80)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(weight_dtype)
    # Reference in float32 from the same rounded values, except the residual sum, which the
    # reference rounds to x's dtype before the statistics (the kernel must too).
    summed = (x + residual) if with_residual else x
    expected, _ = norm.rms_norm_ref(summed.float(), weight.float(), 1e-6)
    x_dev = x.to(DEVICE)
    r_dev = residual.to(DEVICE) if with_residual else None
    x_before = x_dev.clone()
    got, new_residual = norm.rms_norm_triton(x_dev, weight.to(DEVICE), 1e-6, r_dev)
    ref_out, ref_residual = norm.rms_norm_ref(x, weight, 1e-6, residual)
    assert got.dtype == ref_out.dtype and got.shape == ref_out.shape
    assert new_residual.dtype == ref_residual.dtype
    _close(got.cpu(), expected, TOL[dtype])
    if with_residual:
        _close(new_residual.cpu(), ref_residual, TOL[dtype])
    else:
        assert new_residual is x_dev
    assert torch.equal(x_dev, x_before)


# ----------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("head_dim", [48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apply_rotary(head_dim, dtype):
    gen = torch.Generator().manual_seed(90 + head_dim)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).tolist()
    cos_sin = rotary.rotary_cos_sin(inv_freq, 513, "cpu")
    tokens = 11
    q = torch.randn(tokens, 7, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, 3, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 513, (tokens,), generator=gen)
    expected_q, expected_k = rotary.apply_rotary_ref(q.float(), k.float(), positions, cos_sin)
    q_dev, k_dev = q.to(DEVICE), k.to(DEVICE)
    got_q, got_k = rotary.apply_rotary_triton(q_dev, k_dev, positions.to(DEVICE), cos_sin.to(DEVICE))
    assert got_q.dtype == dtype and got_k.dtype == dtype
    _close(got_q.cpu(), expected_q, TOL[dtype])
    _close(got_k.cpu(), expected_k, TOL[dtype])
    assert torch.equal(q_dev.cpu(), q) and torch.equal(k_dev.cpu(), k)  # inputs untouched


def test_rotary_reference_follows_each_steps_positions():
    """The reference reuses a step's cos/sin tables across layers: a new positions tensor, even
    with the same values or after the old one is freed, must never see another step's tables."""
    head_dim = 64
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).tolist()
    cos_sin = rotary.rotary_cos_sin(inv_freq, 64, "cpu")
    q, k = torch.randn(3, 4, head_dim), torch.randn(3, 2, head_dim)

    def closed_form(x, positions):
        angles = positions.float()[:, None, None] * torch.tensor(inv_freq)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)

    for step in range(4):
        positions = torch.tensor([step, 10 + step, 40 - step])
        for _ in range(2):  # two layers of one step
            got_q, got_k = rotary.apply_rotary_ref(q, k, positions, cos_sin)
            torch.testing.assert_close(got_q, closed_form(q, positions), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_k, closed_form(k, positions), atol=1e-5, rtol=1e-5)
        del positions


# ----------------------------------------------------------------------------- dequant_matmul
# Every supported width in one matrix (3, 5, 6 straddle word boundaries), act-order perm, odd N
# (masked columns), group sizes 32 and 64. M = 1 and 3 take the GEMV path (split-K over groups:
# the interpreter pretends 8 SMs), M = 37 the tl.dot path (one split here: the partials would
# outweigh so small a weight; forced below), M = 70 the dequantized weight and torch's matmul.
# Tolerance: the reference dequantizes and multiplies in fp32; the GEMV path
# does too, the tl.dot path feeds fp16/bf16 weights to the dot (fp32 under the interpreter, see
# above) and the last path multiplies them, so bf16 gets the ~2-ulp bound like everything else.


def _packed_matrix(k, n, group_size, bits, asym, seed):
    from qrun.format import MatrixLayout, pack_matrix

    gen = torch.Generator().manual_seed(seed)
    layout = MatrixLayout(k, n, group_size, tuple(bits), asym)
    q = torch.cat([torch.randint(0, 1 << b, (group_size, n), generator=gen) for b in bits])
    scales = torch.randint(1, 256, (len(bits), n), generator=gen).to(torch.uint8)
    scale_max = (torch.rand(n, generator=gen) * 0.05 + 0.01).half()
    mins = torch.randint(-127, 128, (len(bits), n), generator=gen).to(torch.int8) if asym else None
    min_absmax = (torch.rand(n, generator=gen) * 0.2).half() if asym else None
    perm = torch.randperm(k, generator=gen).to(layout.perm_dtype)
    return pack_matrix(q, layout), layout.qgroups(), scales, scale_max, mins, min_absmax, perm


@pytest.mark.parametrize("m", [1, 3, 37, 70])
@pytest.mark.parametrize("dtype, asym, group_size", [
    (torch.float32, False, 32), (torch.float16, True, 32), (torch.bfloat16, False, 64), (torch.bfloat16, True, 32),
])
def test_dequant_matmul(m, dtype, asym, group_size):
    _check_dequant_matmul(m, dtype, asym, group_size)


@pytest.mark.parametrize("splits", [2, 3, 6])
@pytest.mark.parametrize("m", [3, 37])
def test_dequant_matmul_split_k_forced(monkeypatch, splits, m):
    # Both kernels over every split count of six groups, one group a range included.
    monkeypatch.setattr(dm, "partial_splits", lambda *heuristic_inputs: splits)
    _check_dequant_matmul(m, torch.float32, True, 32)


def test_dequant_matmul_split_k_heuristic():
    sms = 132  # an H200
    weight = 4096 * 4096 // 2  # 4-bit codes
    assert dm.partial_splits(1, 4096, 128, weight, sms) >= 16  # a decode GEMV fills the GPU
    assert dm.partial_splits(16, 4096, 128, weight, sms) > 1
    assert dm.partial_splits(64, 1536, 18, 576 * 1536 // 2, sms) == 1  # partials would outweigh the weight
    assert dm.partial_splits(1, 64, 4, 64 * 128 // 2, sms) <= 4  # never more ranges than groups


@pytest.mark.parametrize("asym", [False, True])
def test_dequantize_kernel_writes_the_reference_weight(asym):
    # The path above TILED_MAX_M rows: the kernel's weight [K, N] is dequantize_ref's, value for value.
    bits = [8, 6, 5, 4, 3, 2]
    packed = _packed_matrix(32 * len(bits), 70, 32, bits, asym, seed=7)
    x = torch.zeros(dm.TILED_MAX_M + 1, 32 * len(bits), device=DEVICE)
    on = [t.to(DEVICE) if t is not None else None for t in packed]
    sms = dm.sm_count(x.device)
    weight = dm.launch_output(x, on[0], on[1], sms)
    assert weight.shape == (x.shape[1], 70)
    [launch] = dm.dequant_matmul_launches(x, *on, 32, weight, sms=sms)
    assert launch.kernel is dm._dequantize_kernel
    launch.run()
    _close(weight.cpu(), dm.dequantize_ref(*packed[:-1], 32), TOL[torch.float32])


def _check_dequant_matmul(m, dtype, asym, group_size):
    bits = [8, 6, 5, 4, 3, 2] if group_size == 32 else [8, 5, 3]
    k, n = group_size * len(bits), 70
    packed = _packed_matrix(k, n, group_size, bits, asym, seed=m + group_size)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).half() if asym else None
    expected = dm.dequant_matmul_ref(x.float(), *packed, group_size, bias)
    on = [t.to(DEVICE) if t is not None else None for t in (x, *packed, bias)]
    got = dm.dequant_matmul_triton(*on[:-1], group_size, on[-1])
    assert got.dtype == dtype and got.shape == (m, n)
    scale = expected.abs().max()
    _close(got.cpu() / scale, expected / scale, TOL[dtype])


def test_tile_pruning_checks_fit_with_the_kernels_own_arguments(monkeypatch):
    """The autotuner hands its pruning hook the whole launch (grid, warmup); compiling a tile to
    check that it fits must pass only the kernel's parameters (a GPU run once failed on 'grid')."""
    checked = []
    monkeypatch.setattr(dm, "fits_device", lambda launch, device: checked.append(launch) or True)
    constexprs = dict(GROUP_SIZE=32, HAS_MINS=False, DOT_F32=False)
    on_gpu = type("Arg", (), {"device": torch.device("cuda")})()
    named_args = {name: on_gpu for name in dm._dq_mm_kernel.arg_names
                  if name not in constexprs and name not in ("BLOCK_M", "BLOCK_N")}
    named_args["M"] = 37
    kept = dm._prune_mm_configs(dm._dq_mm_tuned.configs, named_args, grid=lambda meta: (1,), warmup=False,
                                **constexprs)
    assert kept and len(checked) == len(kept)
    for launch in checked:
        assert set(launch.constexprs) <= set(dm._dq_mm_kernel.arg_names) and "grid" not in launch.constexprs


# ----------------------------------------------------------------------------- dispatch


def test_triton_backend_registered():
    impls = kernels.IMPLEMENTATIONS
    assert impls["paged_attention"]["triton"].__name__ == "paged_attention_triton"
    assert impls["store_kv"]["triton"].__name__ == "store_kv_triton"
    assert impls["rms_norm"]["triton"].__name__ == "rms_norm_triton"
    assert impls["apply_rotary"]["triton"].__name__ == "apply_rotary_triton"
    assert impls["dequant_matmul"]["triton"].__name__ == "dequant_matmul_triton"
