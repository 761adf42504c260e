"""Every Triton launch compiles for real GPUs (sm_75 to sm_90) on this CPU-only machine, fits
each target's shared memory without spilling registers, and the launchers choose variants that
do where their first choice does not.

The check (`python -m qrun.kernels.aot`) runs in a child process: this suite interprets the
kernels (TRITON_INTERPRET=1), and interpreted kernels cannot be compiled. Results are cached
under the qrun cache, so after the first run (minutes) this takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import qrun.kernels.paged_attention as pa
from qrun.kernels.aot import TARGETS
from qrun.kernels.kv_quant import QUANTIZED_KV_MIN_CAPABILITY, kv_group_size, storage_dtype

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_paged_attn_kernel", "_merge_splits_kernel", "_dq_gemv_kernel", "_dq_mm_kernel", "_dequantize_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_store_kv_kernel"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "qrun.kernels.aot", "--json", str(out / "aot.json"),
                           "--markdown", str(out / "KERNELS.md")], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "aot.json").read_text())
    data["markdown"] = (out / "KERNELS.md").read_text()
    return data


def test_every_kernel_compiles_for_every_gpu_target_within_its_limits(report):
    assert report["failures"] == []
    run = {(r["kernel"], r["target"]) for r in report["compiled"] if r["chosen"]}
    quantized_kv = {("_store_kv_quantized_kernel", t.name) for t in TARGETS if t.capability >= QUANTIZED_KV_MIN_CAPABILITY}
    assert run == {(kernel, target.name) for kernel in KERNELS for target in TARGETS} | quantized_kv
    for r in report["compiled"]:
        if r["chosen"]:
            assert r["spill_bytes"] == 0 and r["shared_memory"] <= r["shared_memory_limit"], r


def test_turing_runs_smaller_attention_tiles_than_ada(report):
    # The 64-row prefill tile at head_dim 128 spills on sm_75 (Turing's tensor cores need more
    # registers per thread for it), so its launcher takes a smaller one there; sm_89 runs it.
    def prefill_tiles(target: str, chosen: bool) -> set[str]:
        return {r["variant"] for r in report["compiled"]
                if r["kernel"] == "_paged_attn_kernel" and r["target"] == target and r["chosen"] == chosen
                and "HEAD_DIM=128" in r["variant"] and "BLOCK_M=64" in r["variant"]}

    assert prefill_tiles("sm_89", chosen=True)
    assert not prefill_tiles("sm_75", chosen=True) and prefill_tiles("sm_75", chosen=False)


def test_docs_kernel_table_is_the_generated_one(report):
    committed = (ROOT / "docs" / "KERNELS.md").read_text()
    assert committed == report["markdown"], "regenerate: python -m qrun.kernels.aot --markdown docs/KERNELS.md"


def _attention_args(head_dim: int = 128, qpk: int = 4):
    q = torch.empty(4, 2 * qpk, head_dim, dtype=torch.float16, device="meta")
    cache = torch.empty(8, 16, 2, head_dim, dtype=torch.float16, device="meta")
    meta = [torch.empty(n, dtype=torch.int32, device="meta") for n in ((4, 8), (4,), (5,))]
    return (q, cache, cache, *meta, 512, 4096, 0.1, torch.empty_like(q))


def test_four_bit_cache_attention_leaves_out_the_tiles_that_spill_on_every_target():
    # More than 4096 unpacked 4-bit keys or values a tile spilled on sm_80-sm_90 (attention_tile_candidates):
    # the launcher does not compile them at first use only to pass them over, nor does this check.
    for head_dim in (64, 80, 128, 256):
        for max_query_len in (1, 512):
            every = pa.attention_tile_candidates(head_dim, 4, max_query_len)
            four_bit = pa.attention_tile_candidates(head_dim, 4, max_query_len, kv_bits=4)
            unpacked = triton.next_power_of_2(head_dim)
            assert four_bit == [tiles for tiles in every if tiles.block_n * unpacked <= 4096]
            assert four_bit[-1] == every[-1]  # the smallest tile, which runs everywhere
            assert pa.attention_tile_candidates(head_dim, 4, max_query_len, kv_bits=8) == every
    head_dim, bits = 128, 4
    q, cache, _, tables, seq_lens, starts, *rest = _attention_args(head_dim)
    data = torch.empty(*cache.shape[:3], head_dim * bits // 8, dtype=storage_dtype(bits), device="meta")
    scales = torch.empty(*cache.shape[:3], head_dim // kv_group_size(head_dim, bits), 2, dtype=torch.float16,
                         device="meta")
    decode = pa.paged_attention_launches(q, data, data, tables, seq_lens, starts, 1, *rest[1:], scales, scales, sms=1,
                                         fits=lambda launch: True)
    assert decode[0].constexprs["BLOCK_N"] == 32 and decode[0].constexprs["KV_BITS"] == 4


def test_attention_launcher_takes_the_first_tiles_that_fit():
    args = _attention_args()
    prefill = pa.paged_attention_launches(*args, sms=1, fits=lambda launch: True)
    assert prefill[0].constexprs["BLOCK_M"] == 64 and prefill[0].constexprs["BLOCK_N"] == 64

    def small_tiles_only(launch):
        return launch.constexprs["BLOCK_M"] * launch.constexprs["BLOCK_N"] <= 16 * 32

    chosen = pa.paged_attention_launches(*args, sms=1, fits=small_tiles_only)
    assert (chosen[0].constexprs["BLOCK_M"], chosen[0].constexprs["BLOCK_N"]) == (16, 32)
    # Nothing fits: the smallest candidate, which at least runs.
    smallest = pa.paged_attention_launches(*args, sms=1, fits=lambda launch: False)
    assert (smallest[0].constexprs["BLOCK_M"], smallest[0].constexprs["BLOCK_N"]) == (16, 16)
