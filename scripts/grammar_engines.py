"""Why qrun's structured outputs run on llguidance: both maintained grammar engines, measured on
the same model vocabulary and schema.

For each engine: wrapping the tokenizer (once per engine), compiling the mid-size schema of
`structured_outputs_overhead.py` cold, and the per-token cost of a constrained decode (fill the
token bitmask, then accept the token) along a document that satisfies the schema. xgrammar is
optional here (`pip install xgrammar`); the engine qrun runs is `qrun/structured_outputs.py`.

    python scripts/grammar_engines.py smollm2-135m --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenizers import Tokenizer

from qrun import LLM
from qrun.sampling_params import StructuredOutputsParams
from qrun.structured_outputs import GrammarCompiler
from structured_outputs_overhead import SCHEMA

DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "scores": [0.5, 0.93, 0.1], "manager": None, "notes": ["analytical engine", "first program", "poetical science"],
}


def per_token_ms(fill_and_accept, tokens: list[int], repeats: int) -> float:
    """Median over repeats of the mean ms per token of `fill_and_accept(tokens)`."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fill_and_accept(tokens)
        runs.append((time.perf_counter() - start) * 1e3 / len(tokens))
    return statistics.median(runs)


def llguidance_row(tokenizer, vocab_size: int, tokens: list[int], repeats: int) -> dict:
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer.to_json(), vocab_size, tokenizer.eos_token_ids)
    wrap_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1e3
    bitmask = compiler.bitmask(1)

    def walk(ids: list[int]) -> None:
        matcher = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
        for token in ids:
            matcher.fill_bitmask(bitmask, 0)
            matcher.advance(token)

    return {"engine": "llguidance", "wrap_s": wrap_s, "compile_ms": compile_ms,
            "token_ms": per_token_ms(walk, tokens, repeats)}


def xgrammar_row(tokenizer, vocab_size: int, tokens: list[int], repeats: int) -> dict | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        print(f"xgrammar: not measured ({error})")
        return None
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_json()))
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=tokenizer.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    wrap_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def walk(ids: list[int]) -> None:
        matcher = xgr.GrammarMatcher(compiled)
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask)
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token} of a valid document")

    return {"engine": "xgrammar", "wrap_s": wrap_s, "compile_ms": compile_ms,
            "token_ms": per_token_ms(walk, tokens, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # both engines fill masks on one core; keep the comparison fair
    llm = LLM(args.model, enforce_eager=True)
    tokenizer, vocab_size = llm.tokenizer, llm.engine.loaded.config.vocab_size
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    rows = [llguidance_row(tokenizer, vocab_size, tokens, args.repeats),
            xgrammar_row(tokenizer, vocab_size, tokens, args.repeats)]
    print(f"{args.model}: vocabulary {vocab_size}, document {len(tokens)} tokens, medians of {args.repeats}")
    print(f"{'engine':<12} {'tokenizer wrap s':>16} {'schema compile ms':>18} {'mask + accept ms/token':>23}")
    for row in filter(None, rows):
        print(f"{row['engine']:<12} {row['wrap_s']:>16.2f} {row['compile_ms']:>18.1f} {row['token_ms']:>23.3f}")


if __name__ == "__main__":
    main()
