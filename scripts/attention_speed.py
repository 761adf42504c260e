"""One layer's paged attention on the CPU: the C++ kernel (`kernels/cpu_attention.py`) against
the torch reference (`paged_attention_ref`: SDPA on gathered, float32-cast K/V), side by side in
one process, interleaved, warm-up excluded; medians and ratios. Each case is one sequence whose
QUERIES rows attend over KEYS keys (QUERIES > 1: a prefill chunk after KEYS - QUERIES cached
tokens; 1: a decode row), its cache blocks scattered over the pool. For a float cache, also torch's
SDPA in the cache's own dtype on K/V gathered once outside the timing (on a CPU with AMX, bfloat16
SDPA multiplies on the tile unit; prefill cannot use it, its bits depending on the chunking). Quiet
machine only.

    python scripts/attention_speed.py --caches bfloat16,float32,int8,int4 --cases 512x512,512x1024,32x2000,2048x2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qrun.kernels import cpu_library
from qrun.kernels.cpu_attention import paged_attention_cpu
from qrun.kernels.kv_quant import kv_group_size, quantize_kv_ref
from qrun.kernels.paged_attention import paged_attention_ref

FLOAT_CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step(cache: str, queries: int, keys: int, heads: int, kv_heads: int, dim: int, block_size: int) -> tuple:
    """`paged_attention_ref`'s arguments for the case (the queries in the cache's float dtype)."""
    g = torch.Generator().manual_seed(0)
    blocks = -(-keys // block_size)
    dtype = FLOAT_CACHES.get(cache, torch.bfloat16)
    k_cache, v_cache = (torch.randn(blocks + 1, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_scales = v_scales = None
    if cache not in FLOAT_CACHES:
        bits = int(cache.removeprefix("int"))
        (k_cache, k_scales), (v_cache, v_scales) = (quantize_kv_ref(c, bits, kv_group_size(dim, bits))
                                                    for c in (k_cache, v_cache))
    table = torch.randperm(blocks, generator=g).add(1).to(torch.int32)[None]  # block 0 unused, the rest scattered
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    return (q, k_cache, v_cache, table, torch.tensor([keys], dtype=torch.int32),
            torch.tensor([0, queries], dtype=torch.int32), queries, keys, dim ** -0.5, None, k_scales, v_scales)


def sdpa_in_cache_dtype(q, k_cache, v_cache, tables, seq_lens, query_start_loc, queries, keys, scale, *rest):
    """torch's SDPA over the case's one sequence in the cache's dtype, K/V gathered now: a run of it, and its
    arguments."""
    k, v = (c[tables[0].long()].flatten(0, 1)[:keys].transpose(0, 1)[None] for c in (k_cache, v_cache))
    # a square case as SDPA runs it fastest (is_causal); else the causal mask from the first query's position
    mask = None if queries == keys else torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)

    def run(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                scale=scale, enable_gqa=True)

    return run, (q.transpose(0, 1)[None], k, v, mask)


def median_seconds(run, args: tuple, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", default="bfloat16,float32,int8,int4", help="cache kinds, comma-separated")
    parser.add_argument("--cases", default="512x512,512x1024,32x2000,2048x2048,1x2000",
                        help="QUERIESxKEYS, comma-separated")
    parser.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2's)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_library.available():
        raise SystemExit("the C++ kernels did not build here: nothing to compare")
    print(f"threads {torch.get_num_threads()}, {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}; "
          "ms per layer, medians of interleaved runs")
    print("| cache | queries x keys | reference (SDPA) ms | C++ ms | C++ speed-up | SDPA in the cache's dtype ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for cache in args.caches.split(","):
        for case in args.cases.split(","):
            queries, keys = map(int, case.split("x"))
            arguments = step(cache, queries, keys, args.heads, args.kv_heads, args.head_dim, args.block_size)
            runs = {"reference": (paged_attention_ref, arguments), "kernel": (paged_attention_cpu, arguments)}
            if cache in FLOAT_CACHES:
                runs["sdpa"] = sdpa_in_cache_dtype(*arguments)
            times: dict[str, list[float]] = {name: [] for name in runs}
            with torch.inference_mode():
                for run, run_args in runs.values():  # warm-up
                    run(*run_args)
                for _ in range(3):  # rounds, interleaved
                    for name, (run, run_args) in runs.items():
                        times[name].append(median_seconds(run, run_args, args.repeats))
            reference, ours = (statistics.median(times[name]) * 1e3 for name in ("reference", "kernel"))
            sdpa = f"{statistics.median(times['sdpa']) * 1e3:.2f}" if "sdpa" in times else "-"
            print(f"| {cache} | {case} | {reference:.2f} | {ours:.2f} | {reference / ours:.2f}x | {sdpa} |")


if __name__ == "__main__":
    main()
