"""Batched generation speed with each KV cache dtype, side by side in one process (issue 18 asks
that a quantized cache on the CPU be no slower than the float one at batch 32).

One engine per cache dtype, the same requests (greedy, `max_tokens` exact), runs interleaved with
the order alternating, warm-up excluded; medians and ratios against `auto`. Quiet machine only.

    python scripts/kv_cache_speed.py smollm2-135m --num-requests 32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qrun import LLM, SamplingParams

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "workloads" / "mixed_lengths.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--caches", default="auto,int8,int4", help="kv_cache_dtype values, comma-separated")
    parser.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, help="bytes per engine")
    args = parser.parse_args()

    rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines()[:args.num_requests]]
    prompts = [row["prompt"] for row in rows]
    params = [SamplingParams(max_tokens=row["max_tokens"], temperature=0, ignore_eos=True) for row in rows]
    generated = sum(row["max_tokens"] for row in rows)
    engines = {name: LLM(args.model, kv_cache_dtype=name, kv_cache_memory=args.kv_cache_memory)
               for name in args.caches.split(",")}
    for llm in engines.values():  # warm-up, compiling decode steps as a long-running engine has
        if llm.engine.runner.compiled is not None:
            llm.engine.runner.compiled.compile_now()
        llm.generate(prompts[:2], params[:2], progress=False)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines.items())
        for name, llm in order if repeat % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            llm.generate(prompts, params, progress=False)
            seconds[name].append(time.perf_counter() - start)
    first = next(iter(engines))
    base = generated / statistics.median(seconds[first])
    print(f"| kv_cache_dtype | generated tok/s ({len(prompts)} requests, {generated} tokens) | vs {first} |")
    print("| --- | --- | --- |")
    for name, values in seconds.items():
        rate = generated / statistics.median(values)
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
