"""What a quantized KV cache costs in quality: KL(float32 cache || quantized cache) per token.

Every model runs in float32 so that the cache is the only difference: its reference is the same
weights with a float32 cache, scoring the same windows (long ones, so later tokens attend to
many cached keys). Converted models multiply through the float reference path
(QRUN_QUANT_CPU=ref, set here unless given): the fast CPU kernel rounds each input to int8, so a
last-bit change anywhere before a linear moves its output by a rounding step (in a throwaway
experiment the 4.0-bpw SmolLM2 measured KL 0.0018 against itself with its keys merely centred and
rotated in float32, 0 through the reference path). Each quantized cache is measured with the Hadamard rotation qrun uses and
without it, to show what the rotation buys. Targets (issue 18): int8 KL <= 0.002, int4 <= 0.02.

    python scripts/kv_cache_quality.py smollm2-135m out/smol-4.0
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("QRUN_QUANT_CPU", "ref")  # before qrun reads it (module docstring)

import torch  # noqa: E402

from qrun.kv_cache import KVCacheSpec  # noqa: E402
from qrun.loader import load_model  # noqa: E402
from qrun.perplexity import evaluate  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "text"
TARGETS = {8: 0.002, 4: 0.02}
CACHES = {"float32": KVCacheSpec(torch.float32),
          "int8": KVCacheSpec(torch.float32, 8), "int8-unrotated": KVCacheSpec(torch.float32, 8, rotate=False),
          "int4": KVCacheSpec(torch.float32, 4), "int4-unrotated": KVCacheSpec(torch.float32, 4, rotate=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="models to measure (name, folder or .gguf)")
    parser.add_argument("--text", nargs="+", default=[str(SHARED / "brown_k*"), str(SHARED / "brown_l*")])
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens of each file (default 8192)")
    parser.add_argument("--ctx", type=int, default=2048, help="window length (default 2048)")
    parser.add_argument("--caches", default="float32,int8,int8-unrotated,int4,int4-unrotated",
                        help="which caches to measure, comma-separated (default: all)")
    args = parser.parse_args()
    caches = args.caches.split(",")
    unknown = set(caches) - set(CACHES)
    if unknown:
        parser.error(f"--caches: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CACHES)}")

    print(f"QRUN_QUANT_CPU={os.environ['QRUN_QUANT_CPU']}")
    print("| model | cache | rotation | KL vs float32 cache | ppl | target | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        loaded = load_model(name, dtype="float32", device="cpu")
        reference_logprobs: dict = {}
        for cache in caches:
            spec = CACHES[cache]
            start = time.perf_counter()
            result = evaluate(loaded, args.text, ctx=args.ctx, max_tokens=args.max_tokens, ref=loaded,
                              kv_cache_dtype=spec, ref_cache=reference_logprobs)
            if spec.quantized:
                target = TARGETS[spec.bits]
                verdict = f"<= {target} ({'meets' if result['kl'] <= target else 'misses'})"
            else:
                verdict = "0 (the reference itself)"
            print(f"| {name} | {spec.name} | {'yes' if spec.quantized and spec.rotate else 'no'} | {result['kl']:.5f} "
                  f"| {result['ppl']:.3f} | {verdict} | {time.perf_counter() - start:.0f} |", flush=True)

if __name__ == "__main__":
    main()
