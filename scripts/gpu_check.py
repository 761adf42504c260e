#!/usr/bin/env python
"""GPU check of the Triton kernels: correctness for real (compiled, not interpreted) and speed.

    python scripts/gpu_check.py            # everything, < 8 minutes on one GPU
    python scripts/gpu_check.py --no-tests # skip the pytest pass, only the benchmark table
    python scripts/gpu_check.py --no-tests --only dequant_matmul,engine_decode  # some rows

1. Runs tests/test_triton_kernels.py on the GPU (that module compiles the kernels when CUDA is
   present), so every reference comparison there is repeated with real codegen.
2. Measures the machine's floors: device copy bandwidth (a large tensor copy; bytes read +
   written / time) and the bf16 matmul rate (8192^3 torch.matmul).
3. For each benchmark row: checks the Triton result against the torch reference on the very
   inputs it times, then times it with triton.testing.do_bench and prints one table:
   time, the floor (bytes that must move / copy bandwidth, or FLOPs / bf16 matmul rate,
   whichever is larger), the floor as % of the time (100% = at the floor), and a baseline
   (torch SDPA for prefill attention, the torch reference elsewhere).
4. Times the whole engine decoding a SmolLM2-135M-shaped model (random weights) at batch 1 and
   64, with CUDA graphs and without, against the same floors and the engine with the torch
   references.

Adding a row: write a function `bench_xxx(ctx) -> list[Row]` and list it in BENCHES.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    name: str
    shape: str
    ms: float  # measured Triton time
    bytes: float = 0.0  # bytes that must move
    flops: float = 0.0  # FLOPs that must be done
    baseline_name: str = ""
    baseline_ms: float | None = None
    max_err: float | None = None  # max abs error vs the reference, relative to max |ref|
    note: str = ""


@dataclass
class Ctx:
    device: torch.device
    copy_bw: float  # bytes / s
    bf16_flops: float  # FLOP / s
    card_bw: float | None  # bytes / s, the card's specified peak (qrun.memory_plan.CARDS), if known


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def check(name: str, err: float, bound: float) -> None:
    if not err <= bound:  # also catches NaN
        raise AssertionError(f"{name}: relative error {err:.3g} above {bound:.3g}")


# ------------------------------------------------------------------------------------ floors


def measure_floors(device: torch.device) -> Ctx:
    n = 1 << 28  # 1 GiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 4 / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = bench(lambda: a @ b)
    flops = 2 * 8192 ** 3 / (ms * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    from qrun.memory_plan import card_named

    props = torch.cuda.get_device_properties(device)
    card = card_named(props.name, props.total_memory)
    return Ctx(device, copy_bw, flops, card.bandwidth if card else None)


# ------------------------------------------------------------------------------------ benches


def _paged(seq_specs, hkv, qpk, d, bs, dtype, device, seed=0):
    """A scattered paged cache holding every sequence; specs = (cached, new) per sequence."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = [c + n for c, n in seq_specs]
    nblk = [-(-L // bs) for L in lens]
    num_blocks = sum(nblk) + 8
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    used = 0
    for s, k in enumerate(nblk):
        bt[s, :k] = perm[used:used + k].int()
        used += k
    kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    vc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    qlens = [n for _, n in seq_specs]
    q = torch.randn(sum(qlens), hkv * qpk, d, dtype=dtype, device=device)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return (q, kc, vc, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device), qsl,
            max(qlens), max(lens), d ** -0.5)


def bench_attention_prefill(ctx: Ctx) -> list[Row]:
    import torch.nn.functional as F

    from qrun.kernels.paged_attention import paged_attention_ref, paged_attention_triton

    rows = []
    for seqs, length, hkv, qpk, d in [(4, 2048, 8, 4, 128), (8, 1024, 3, 3, 64)]:
        args = _paged([(0, length)] * seqs, hkv, qpk, d, 16, torch.bfloat16, ctx.device)
        out = torch.empty_like(args[0])
        err = rel_err(paged_attention_triton(*args, out=out), paged_attention_ref(*args))
        check("prefill attention", err, 2e-2)
        ms = bench(lambda: paged_attention_triton(*args, out=out))
        hq = hkv * qpk
        # Dense SDPA on the same tokens (contiguous K/V, flash backend): the speed to match.
        q = torch.randn(seqs, hq, length, d, dtype=torch.bfloat16, device=ctx.device)
        k = torch.randn(seqs, hkv, length, d, dtype=torch.bfloat16, device=ctx.device)
        v = torch.randn_like(k)
        sdpa_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        flops = seqs * 2 * 2 * hq * d * length * length / 2  # QK^T and PV, causal half
        rows.append(Row("attention prefill", f"{seqs}x{length} Hq{hq}/Hkv{hkv} D{d}", ms, flops=flops,
                        baseline_name="SDPA", baseline_ms=sdpa_ms, max_err=err))
    return rows


def bench_attention_decode(ctx: Ctx) -> list[Row]:
    import qrun.kernels.paged_attention as pa
    from qrun.kernels.launch import fits_device, sm_count

    rows = []
    cases = [(64, 2048, 8, 4, 128, "64 seqs x 2k"), (64, 2048, 3, 3, 64, "64 seqs x 2k"),
             (2, 32768, 8, 4, 128, "few long: split-K")]
    for seqs, ctx_len, hkv, qpk, d, label in cases:
        args = pa_args = _paged([(ctx_len - 1, 1)] * seqs, hkv, qpk, d, 16, torch.bfloat16, ctx.device, seed=1)
        out = torch.empty_like(args[0])
        err = rel_err(pa.paged_attention_triton(*args, out=out), pa.paged_attention_ref(*args))
        check("decode attention", err, 2e-2)
        ms = bench(lambda: pa.paged_attention_triton(*pa_args, out=out))
        kv_bytes = 2 * seqs * ctx_len * hkv * d * 2
        ref_ms = bench(lambda: pa.paged_attention_ref(*pa_args, out=out))
        note = ""
        if "split" in label:
            unsplit = pa.paged_attention_launches(*pa_args, out, sms=sm_count(ctx.device),
                                                  fits=lambda launch: fits_device(launch, ctx.device), num_splits=1)
            note = f"no split-K: {bench(lambda: [launch.run() for launch in unsplit]) * 1e3:.0f} us"
        rows.append(Row("attention decode", f"{label} Hq{hkv * qpk}/Hkv{hkv} D{d}", ms, bytes=kv_bytes,
                        baseline_name="torch ref", baseline_ms=ref_ms, max_err=err, note=note))
    return rows


def bench_store_kv(ctx: Ctx) -> list[Row]:
    from qrun.kernels.cache_ops import store_kv_ref, store_kv_triton

    t, hkv, d, bs = 8192, 8, 128, 16
    k = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=ctx.device)
    v = torch.randn_like(k)
    kc = torch.zeros(t // bs + 64, bs, hkv, d, dtype=torch.bfloat16, device=ctx.device)
    vc, kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * bs, device=ctx.device)[:t]
    store_kv_triton(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc2, vc2, slots)
    if not (torch.equal(kc, kc2) and torch.equal(vc, vc2)):
        raise AssertionError("store_kv differs from the reference")
    ms = bench(lambda: store_kv_triton(k, v, kc, vc, slots))
    ref_ms = bench(lambda: store_kv_ref(k, v, kc2, vc2, slots))
    return [Row("store_kv", f"T{t} Hkv{hkv} D{d}", ms, bytes=4 * k.numel() * 2, baseline_name="torch ref",
                baseline_ms=ref_ms, max_err=0.0)]


def bench_rms_norm(ctx: Ctx) -> list[Row]:
    from qrun.kernels.norm import rms_norm_ref, rms_norm_triton

    rows = []
    for tokens, hidden in [(8192, 4096), (8192, 576)]:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=ctx.device)
        r = torch.randn_like(x)
        w = torch.randn(hidden, dtype=torch.bfloat16, device=ctx.device)
        err = rel_err(rms_norm_triton(x, w, 1e-6, r)[0], rms_norm_ref(x, w, 1e-6, r)[0])
        check("rms_norm", err, 1.6e-2)
        ms = bench(lambda: rms_norm_triton(x, w, 1e-6, r))
        ref_ms = bench(lambda: rms_norm_ref(x, w, 1e-6, r))
        rows.append(Row("rms_norm+residual", f"{tokens}x{hidden}", ms, bytes=4 * x.numel() * 2,
                        baseline_name="torch ref", baseline_ms=ref_ms, max_err=err))
    return rows


def bench_rotary(ctx: Ctx) -> list[Row]:
    from qrun.kernels.rotary import apply_rotary_ref, apply_rotary_triton, rotary_cos_sin

    t, hq, hkv, d = 8192, 32, 8, 128
    inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)).tolist()
    cs = rotary_cos_sin(inv_freq, 8192, ctx.device)
    q = torch.randn(t, hq, d, dtype=torch.bfloat16, device=ctx.device)
    k = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=ctx.device)
    pos = torch.randint(0, 8192, (t,), device=ctx.device)
    got, ref = apply_rotary_triton(q, k, pos, cs), apply_rotary_ref(q, k, pos, cs)
    err = max(rel_err(got[0], ref[0]), rel_err(got[1], ref[1]))
    check("rotary", err, 1.6e-2)
    ms = bench(lambda: apply_rotary_triton(q, k, pos, cs))
    ref_ms = bench(lambda: apply_rotary_ref(q, k, pos, cs))
    moved = 2 * (q.numel() + k.numel()) * 2 + t * d * 4
    return [Row("rotary", f"T{t} Hq{hq} Hkv{hkv} D{d}", ms, bytes=moved, baseline_name="torch ref",
                baseline_ms=ref_ms, max_err=err)]


def bench_dequant_matmul(ctx: Ctx) -> list[Row]:
    """A mixed ~4.3-bit 4096 x 4096 matrix from one row to a prefill's 2048, and SmolLM2's MLP
    (576 -> 1536) at a decode step's 1, 16 and 64 rows; each row's note times the path the launcher
    did not take (the evidence for its thresholds)."""
    import qrun.kernels.dequant_matmul as dm
    from qrun.kernels.dequant_matmul import dequant_matmul_ref, dequant_matmul_triton

    rows = []
    for k, n, row_counts in ((4096, 4096, (1, 4, 16, 64, 256, 2048)), (576, 1536, (1, 16, 64))):
        packed, gs = mixed_bit_matrix(k, n, ctx.device)
        packed_bytes = sum(t.nbytes for t in packed if t is not None)
        dense = torch.randn(n, k, dtype=torch.bfloat16, device=ctx.device)
        for m in row_counts:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=ctx.device)
            args = (x, *packed, gs)
            err = rel_err(dequant_matmul_triton(*args), dequant_matmul_ref(*args))
            check("dequant_matmul", err, 2e-2)
            ms = bench(lambda: dequant_matmul_triton(*args))
            dense_ms = bench(lambda: torch.nn.functional.linear(x, dense))
            if m <= dm.GEMV_MAX_M:
                other, setting = "at 2 programs/SM", {"PROGRAMS_PER_SM": 2}
            elif m <= dm.TILED_MAX_M:
                other, setting = "dequantize + matmul", {"TILED_MAX_M": dm.GEMV_MAX_M}
            else:
                other, setting = "tiled split-K", {"TILED_MAX_M": m}
            with module_settings(dm, **setting):
                other_ms = bench(lambda: dequant_matmul_triton(*args)) if m <= 256 else None
            moved = packed_bytes + 2 * m * (k + n)
            rows.append(Row("dequant_matmul", f"M{m} K{k} N{n} ~{8 * packed_bytes / (k * n):.2f}bpw", ms,
                            bytes=moved, flops=2 * m * n * k, baseline_name="bf16 dense", baseline_ms=dense_ms,
                            max_err=err, note=f"{other}: {other_ms * 1e3:.1f} us" if other_ms is not None else ""))
    return rows


def mixed_bit_matrix(k: int, n: int, device: torch.device) -> tuple[tuple, int]:
    """Random packed weights of k inputs x n outputs in groups of 64, 1/16 of them 8-bit, 1/8
    6-bit, 3/16 3-bit, the rest 4-bit, asymmetric, act-order permuted: the dequant_matmul
    arguments (qweight, qgroups, scales, scale_max, mins, min_absmax, perm) and the group size."""
    from qrun.format import MatrixLayout, pack_matrix

    gs = 64
    groups = k // gs
    bits = [8] * (groups // 16) + [6] * (groups // 8) + [3] * (3 * groups // 16)
    bits += [4] * (groups - len(bits))
    layout = MatrixLayout(k, n, gs, tuple(bits), True)
    q = torch.cat([torch.randint(0, 1 << b, (gs, n)) for b in bits])
    return (pack_matrix(q, layout).to(device), layout.qgroups().to(device),
            torch.randint(1, 256, (len(bits), n), dtype=torch.uint8, device=device),
            (torch.rand(n) * 0.02 + 0.01).half().to(device),
            torch.randint(-127, 128, (len(bits), n), dtype=torch.int8, device=device),
            (torch.rand(n) * 0.1).half().to(device), torch.randperm(k).to(layout.perm_dtype).to(device)), gs


@contextlib.contextmanager
def module_settings(module, **values):
    """`module`'s attributes set to `values` inside the block, restored after it."""
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def smollm2_shaped_checkpoint(folder: Path) -> Path:
    """SmolLM2-135M's architecture with random bfloat16 weights: the real checkpoint (98 MB) does not
    travel to a GPU machine, and random weights time the same bytes and launches."""
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_checkpoint import write_byte_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                      rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=258,
                                      bos_token_id=None)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


def bench_engine_decode(ctx: Ctx, measured: str = "triton") -> list[Row]:
    """The whole engine (LLM.generate) decoding on the GPU: ms per step at batch 1 and 64 (32-token
    prompts, 128 new tokens), against the bytes a step must read (weights + KV); the baseline is the
    same engine with the torch references (QRUN_KERNELS=torch). The note gives the engine without
    CUDA graphs (enforce_eager), the share of the run the GPU was busy (far below 100%: the steps
    are bound by launches and Python, not by the GPU) and how many greedy outputs equal the eager
    engine's (graphs must change none) and the torch references' (bfloat16 near-ties of random
    weights may). `measured` is the QRUN_KERNELS backend timed (another than triton runs the row on
    a CPU, to check the script itself without a GPU)."""
    import gc
    import os
    import tempfile

    from qrun import LLM, SamplingParams
    from qrun.bench import decode_step_bytes

    prompt_len, new_tokens, batches = 32, 128, (1, 64)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engines = {"graphs": (measured, False), "eager": (measured, True), "torch": ("torch", True)}
    mean_context = prompt_len + new_tokens // 2
    step_s, busy, tokens, step_bytes = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = smollm2_shaped_checkpoint(Path(tmp) / "smollm2-shaped")
        try:
            for name, (backend, enforce_eager) in engines.items():
                os.environ["QRUN_KERNELS"] = backend  # read once, when the model picks its kernels
                llm = LLM(str(model), dtype="bfloat16", device=str(ctx.device), max_num_seqs=max(batches),
                          kv_cache_memory=4 << 30, enforce_eager=enforce_eager)
                for batch in batches:
                    prompts = [[(7 * i + j) % 250 for j in range(prompt_len)] for i in range(batch)]
                    # Warm-ups at the timed batch: Triton compiles a kernel per specialization at its first
                    # launch, and the second prefills from the prefix cache the first filled, as the timed run does.
                    for _ in range(2):
                        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), progress=False)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    outputs = llm.generate(prompts, params, progress=False)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - start
                    failed = [o.error for o in outputs if o.error or len(o.outputs[0].token_ids) != new_tokens]
                    if failed:
                        raise AssertionError(f"{name} B{batch}: {len(failed)} requests failed, first: {failed[0]}")
                    tokens[name, batch] = [o.outputs[0].token_ids for o in outputs]
                    step_s[name, batch] = wall / new_tokens
                    if name == "graphs":
                        busy[batch] = kernel_seconds(llm, prompts, params) / wall
                        # weights once, and every sequence's K/V at the mean context
                        step_bytes[batch] = decode_step_bytes(llm.engine.runner.model, batch * mean_context,
                                                              llm.engine.cache_spec)
                        parameters = sum(p.numel() for p in llm.engine.runner.model.parameters())
                del llm
                gc.collect()
                torch.cuda.empty_cache()
        finally:  # the rows after this one, and a caller's process, pick their own kernels
            os.environ.pop("QRUN_KERNELS", None)
    rows = []
    for batch in batches:
        step = step_s["graphs", batch]

        def same_as(name: str) -> int:
            return sum(a == b for a, b in zip(tokens["graphs", batch], tokens[name, batch]))
        rows.append(Row("engine decode step", f"SmolLM2-135M shape bf16 B{batch}", step * 1e3,
                        bytes=step_bytes[batch], flops=2 * batch * parameters,
                        baseline_name="QRUN_KERNELS=torch", baseline_ms=step_s["torch", batch] * 1e3,
                        note=f"{batch / step:.0f} tok/s; eager {step_s['eager', batch] * 1e3:.1f} ms; GPU busy "
                             f"{100 * busy[batch]:.0f}%; greedy = eager's {same_as('eager')}/{batch}, "
                             f"torch's {same_as('torch')}/{batch}"))
    return rows


def kernel_seconds(llm, prompts, params) -> float:
    """Device time of every kernel a generate runs (torch.profiler), to set against its wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, progress=False)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) * 1e-6


BENCHES = [
    bench_attention_prefill,
    bench_attention_decode,
    bench_store_kv,
    bench_rms_norm,
    bench_rotary,
    bench_dequant_matmul,
    bench_engine_decode,
]


# ------------------------------------------------------------------------------------ output


def print_table(ctx: Ctx, rows: list[Row]) -> None:
    spec = f", specified {ctx.card_bw / 1e9:.0f} GB/s" if ctx.card_bw else " (card not in qrun.memory_plan.CARDS)"
    print(f"\ncopy bandwidth {ctx.copy_bw / 1e9:.0f} GB/s{spec}, bf16 matmul {ctx.bf16_flops / 1e12:.0f} TFLOP/s")
    header = ("kernel", "shape", "time us", "floor us", "% floor", "bound", "% card BW", "baseline us", "max rel err",
              "note")
    lines = []
    for r in rows:
        t_bytes = r.bytes / ctx.copy_bw
        t_flops = r.flops / ctx.bf16_flops
        floor = max(t_bytes, t_flops)
        bound = "mem" if t_bytes >= t_flops else "flops"
        base = f"{r.baseline_ms * 1e3:.1f} ({r.baseline_name})" if r.baseline_ms is not None else "-"
        err = f"{r.max_err:.1e}" if r.max_err is not None else "-"
        card = f"{100 * r.bytes / (r.ms * 1e-3) / ctx.card_bw:.0f}%" if ctx.card_bw and r.bytes else "-"
        lines.append((r.name, r.shape, f"{r.ms * 1e3:.1f}", f"{floor * 1e6:.1f}",
                      f"{100 * floor / (r.ms * 1e-3):.0f}%", bound, card, base, err, r.note))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    print(fmt.format(*("-" * w for w in widths)))
    for line in lines:
        print(fmt.format(*line))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest correctness pass")
    names = [fn.__name__.removeprefix("bench_") for fn in BENCHES]
    parser.add_argument("--only", type=lambda value: value.split(","), default=names,
                        help=f"comma-separated rows to time (default: all of {','.join(names)})")
    args = parser.parse_args()
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        parser.error(f"--only: no rows named {', '.join(unknown)}; choose from {', '.join(names)}")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing to check. "
              "Run it on a GPU machine; on CPU use `TRITON_INTERPRET=1 pytest tests/test_triton_kernels.py`.",
              file=sys.stderr)
        return 2
    start = time.time()
    failed = False
    if not args.no_tests:
        print("== pytest tests/test_triton_kernels.py (compiled, on the GPU)", flush=True)
        env_cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_triton_kernels.py"), "-q", "-x",
                   "-p", "no:cacheprovider"]
        result = subprocess.run(env_cmd, cwd=ROOT, timeout=300)
        failed = result.returncode != 0
        print(f"== pytest {'FAILED' if failed else 'passed'} ({time.time() - start:.0f} s)", flush=True)
    device = torch.device("cuda")
    ctx = measure_floors(device)
    rows: list[Row] = []
    for fn in BENCHES:
        if fn.__name__.removeprefix("bench_") not in args.only:
            continue
        try:
            rows.extend(fn(ctx))
        except Exception as exc:  # one broken row must not hide the others
            failed = True
            print(f"!! {fn.__name__}: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()
    print_table(ctx, rows)
    print(f"\n{'FAILED' if failed else 'all checks passed'} in {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
