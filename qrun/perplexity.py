"""`qrun ppl MODEL --text FILE`: perplexity over non-overlapping windows, and KL against a reference.

Each text file is tokenized without special tokens (no BOS), cut to its first --max-tokens
tokens, and split into non-overlapping windows of --ctx tokens; every window is scored on
its own (tokens 1..n-1 predicted from their prefix inside the window). With --ref, the
reference model scores the same windows and the mean per-token KL(ref || model) is reported.
--kv-cache-dtype applies to the model only (the reference keeps a float cache in its compute
dtype), so `qrun ppl M --kv-cache-dtype int4 --ref M` measures what the quantized cache loses.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qrun.errors import QrunError
from qrun.options import add_placement_arguments

if TYPE_CHECKING:
    from qrun.kv_cache import KeyCalibration, KVCacheSpec


class EvalError(QrunError):
    """Evaluation input is missing or unusable."""


def add_ppl_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model to evaluate: folder, .gguf, alias or hub id")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE",
                        help="UTF-8 text file(s) (globs allowed); each is scored separately, results pooled")
    parser.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    parser.add_argument("--max-tokens", type=int, help="score only the first N tokens of each file")
    parser.add_argument("--ref", help="reference model for KL(ref || model), e.g. the unquantized original")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_placement_arguments(parser)


def run_ppl(args: argparse.Namespace) -> int:
    result = evaluate(args.model, args.text, ctx=args.ctx, max_tokens=args.max_tokens, ref=args.ref,
                      device=args.device or "auto", dtype=args.dtype or "auto",
                      kv_cache_dtype=args.kv_cache_dtype or "auto")
    if args.json:
        print(json.dumps(result))
    else:
        line = f"ppl {result['ppl']:.4f} over {result['tokens']} tokens"
        if result["kl"] is not None:
            line += f"; KL(ref||model) {result['kl']:.5f}"
        if result["bpw"] is not None:
            line += f"; {result['bpw']:.3f} bpw"
        print(line)
    return 0


def _text_files(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matches:
            raise EvalError(f"--text {pattern} matches no file")
        files.extend(Path(m) for m in matches)
    return files


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EvalError(f"{path} is not UTF-8 text") from None
    except OSError as err:
        raise EvalError(f"cannot read {path}: {err.strerror or err}") from None
    if not text.strip():
        raise EvalError(f"{path} is empty")
    return text


def window_logprobs(model, ids: torch.Tensor, kv_cache_dtype: "str | KVCacheSpec" = "auto",
                    calibrations: list[KeyCalibration] | None = None) -> torch.Tensor:
    """float32 log-probabilities [n, vocab] of one window (one sequence, fresh cache); a
    quantized cache calibrates its keys by `calibrations` (`kv_cache.key_calibration`)."""
    from qrun.kv_cache import KVCache, KVCacheSpec
    from qrun.model import AttentionMetadata

    n = ids.shape[0]
    device = model.cos_sin.device
    spec = kv_cache_dtype if isinstance(kv_cache_dtype, KVCacheSpec) else KVCacheSpec.parse(
        kv_cache_dtype, model.embed_tokens.weight.dtype)
    cache = KVCache(model.config, 1, n, spec, device, calibrations)
    meta = AttentionMetadata.build([(0, n)], [[0]], n, device)  # the whole window in one block
    with torch.inference_mode():
        hidden = model(ids.to(device), torch.arange(n, device=device), meta, cache)
        return model.compute_logits(hidden).float().log_softmax(-1)


def evaluate(model, text, *, ctx: int = 512, max_tokens: int | None = None, ref=None,
             device: str = "auto", dtype: str = "auto", kv_cache_dtype: "str | KVCacheSpec" = "auto",
             progress=None, ref_cache: dict | None = None) -> dict:
    """{"ppl", "kl", "tokens", "bpw", "files"}; `model`/`ref` are names or LoadedModel objects.

    `ref_cache` (a dict kept by the caller) holds the reference's log-probabilities per window,
    so scoring several models against one reference runs the reference once.
    """
    from qrun.kv_cache import KVCacheSpec, key_calibration
    from qrun.loader import LoadedModel, load_model

    if ctx < 2:
        raise EvalError("--ctx must be at least 2")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError("--max-tokens must be at least 2")
    files = _text_files([text] if isinstance(text, (str, Path)) else [str(t) for t in text])
    texts = [_read(f) for f in files]
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
    reference = None
    if ref is not None:
        reference = ref if isinstance(ref, LoadedModel) else load_model(ref, dtype=dtype, device=device)
        if reference.config.vocab_size != loaded.config.vocab_size:
            raise EvalError(f"--ref has vocabulary {reference.config.vocab_size}, the model {loaded.config.vocab_size}")
    ctx = min(ctx, loaded.config.max_model_len)
    spec = (kv_cache_dtype if isinstance(kv_cache_dtype, KVCacheSpec)
            else KVCacheSpec.parse(kv_cache_dtype, loaded.dtype, loaded.kv_dtype))
    calibrations = key_calibration(loaded.model, loaded.tokenizer) if spec.quantized else None
    nll_sum, kl_sum, count = 0.0, 0.0, 0
    for path, body in zip(files, texts):
        ids = torch.tensor(loaded.tokenizer.encode(body, add_special_tokens=False), dtype=torch.long)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        for start in range(0, ids.shape[0], ctx):
            window = ids[start:start + ctx]
            if window.shape[0] < 2:
                continue
            logp = window_logprobs(loaded.model, window, spec, calibrations)
            targets = window[1:].to(logp.device)
            nll_sum += -logp[:-1].gather(1, targets[:, None]).sum().item()
            if reference is not None:
                key = (str(path), start, ctx)
                if ref_cache is not None and key in ref_cache:
                    ref_logp = ref_cache[key].to(logp.device)
                else:
                    ref_logp = window_logprobs(reference.model, window).to(logp.device)[:-1]
                    if ref_cache is not None:
                        ref_cache[key] = ref_logp
                kl_sum += (ref_logp.exp() * (ref_logp - logp[:-1])).sum().item()
            count += window.shape[0] - 1
            if progress:
                progress(count)
    if count == 0:
        raise EvalError("the text has fewer than 2 tokens to score")
    qconfig = loaded.hf_config.get("quantization_config") or {}
    return {"ppl": math.exp(nll_sum / count), "kl": kl_sum / count if reference is not None else None,
            "tokens": count, "bpw": qconfig.get("achieved_bpw"), "files": [f.name for f in files]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qrun ppl")
    add_ppl_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_ppl(args)
    except QrunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
