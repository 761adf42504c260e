"""What structured outputs cost: grammar set-up per schema, and decode step time with half of a
batch constrained against the same batch all free (target: at most 10% slower per step).

Both batches decode the same prompts for exactly the same number of tokens (checked), so they
run the same steps; the runs are interleaved and the median of each is compared. Run it on a
quiet machine.

    python scripts/structured_outputs_overhead.py smollm2-135m --batch 32 --tokens 48 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qrun import LLM, SamplingParams
from qrun.sampling_params import StructuredOutputsParams

# A mid-size schema: nesting, arrays, enums, bounds, $defs, anyOf, a pattern.
SCHEMA = {
    "type": "object",
    "$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city"]}},
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"$ref": "#/$defs/address"},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 8},
        "manager": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "notes": {"type": "array", "items": {"type": "string"}, "maxItems": 20},
    },
    "required": ["name", "age", "role", "address", "notes"],
}
WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "workloads" / "mixed_lengths.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48, help="tokens each request decodes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(args.model)
    start = time.perf_counter()
    compiler = llm.engine.grammar_compiler  # wraps the tokenizer once (not per schema)
    wrap_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(100):
        compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    cached_ms = (time.perf_counter() - start) * 10
    bitmask = compiler.bitmask(1)
    start = time.perf_counter()
    for _ in range(100):
        matcher.fill_bitmask(bitmask, 0)
    mask_ms = (time.perf_counter() - start) * 10

    prompts = [json.loads(line)["prompt"][:400] for line in WORKLOAD.read_text().splitlines()[:args.batch]]
    free = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    # Both halves decode exactly `tokens` tokens, so the two batches run the same steps: the
    # constrained half follows the schema with "notes" required to hold more items than fit, so
    # its grammar cannot complete (nor allow EOS) within the budget.
    endless = {**SCHEMA, "properties": {**SCHEMA["properties"], "notes": {
        "type": "array", "items": {"type": "string"}, "minItems": 10_000}}}
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=endless))
    batches = {"all free": [free] * len(prompts),
               "half constrained": [constrained if i % 2 else free for i in range(len(prompts))]}
    llm.generate(prompts[:2], [free, constrained], progress=False)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in batches}
    for repeat in range(args.repeats):
        order = list(batches.items())
        for name, params in order if repeat % 2 == 0 else order[::-1]:  # neither always runs first
            tokens_before = llm.engine.num_generated_tokens
            start = time.perf_counter()
            llm.generate(prompts, params, progress=False)
            generated = llm.engine.num_generated_tokens - tokens_before
            assert generated == len(prompts) * args.tokens, "a request stopped early: the batches differ"
            times[name].append((time.perf_counter() - start) / generated)
    base = statistics.median(times["all free"])
    print(f"wrapping the tokenizer ({compiler.vocab_size} tokens): {wrap_s:.2f} s, once per engine")
    print(f"grammar set-up of a mid-size schema: {compile_ms:.1f} ms the first time, {cached_ms:.2f} ms cached")
    print(f"one sequence's token mask at the schema's start: {mask_ms:.2f} ms")
    print("| batch | time per generated token (ms) | vs all free |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        value = statistics.median(values)
        print(f"| {name} ({len(prompts)} requests, {args.tokens} tokens each) | {value * 1e3:.2f} | {value / base:.3f}x |")


if __name__ == "__main__":
    main()
