"""Quality (and CPU decode speed) of qrun's mixed-bit GPTQ against RTN and uniform GPTQ.

SmolLM2-135M (the Q4_1 GGUF, dequantized to float32, is the reference) is converted at each
target bpw; every model is scored on the first --max-tokens tokens of each held-out file
(brown_k*, brown_l*) in 512-token windows without BOS: mean per-token KL(ref || model) first,
perplexity second. Baselines at each width of --uniform-bits: round-to-nearest and uniform GPTQ
(one candidate everywhere, same pipeline), both group 128 (snapped to 96 where K = 576), and
mixed-bit converted at exactly the uniform GPTQ model's bpw beside them.

    python scripts/bench_quality.py                      # default preset, 2.5 3.0 4.0 4.65 5.0 bpw
    python scripts/bench_quality.py --preset fast        # what fits a busy 2-core machine
    python scripts/bench_quality.py --preset fast --targets 4.0 --no-baselines --max-tokens 2048
    python scripts/bench_quality.py --speed-only --speed-model OUT_DIR

Run one CPU benchmark at a time. Results: a table on stdout and --results JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

from qrun.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
SHARED_TEXT = ROOT.parent / "shared" / "data" / "text"
MODEL = "smollm2-135m"


def held_out() -> list[str]:
    files = sorted(str(p) for p in SHARED_TEXT.glob("brown_k*")) + sorted(str(p) for p in SHARED_TEXT.glob("brown_l*"))
    if not files:
        sys.exit(f"held-out text not found under {SHARED_TEXT}")
    return files


def fake_quant_rtn(ref_name: str, bits: int) -> tuple[object, float]:
    """The original model with every decoder linear replaced by its RTN reconstruction."""
    from qrun.convert.gptq import Candidate, rtn_quantize
    from qrun.format import LAYER_LINEARS
    from qrun.loader import load_model

    loaded = load_model(ref_name, dtype="float32", device="cpu", fuse_projections=False)
    total_bits = total_weights = 0
    for layer in loaded.model.layers:
        for name in LAYER_LINEARS:
            lin = layer.get_submodule(name)
            qm = rtn_quantize(lin.weight.data, Candidate(128, ((bits, 1.0),)))
            lin.weight.data = qm.dequantized()
            total_bits += qm.layout.storage_bits()  # original column order: no perm
            total_weights += qm.layout.in_features * qm.layout.out_features
    return loaded, total_bits / total_weights


def uniform_measurement(measurement: Path, candidate: str, out: Path) -> float | None:
    """A measurement file offering only `candidate`; returns the bpw it implies (None: not measured)."""
    data = json.loads(measurement.read_text())
    data["candidates"] = [c for c in data["candidates"] if c["name"] == candidate]
    if not data["candidates"]:
        return None
    bits = weights = 0
    for block in data["blocks"]:
        block["results"] = [r for r in block["results"] if r["candidate"] == candidate]
        bits += block["results"][0]["bits"]
        weights += block["weights"]
    atomic_write_text(out, json.dumps(data))
    return bits / weights


def decode_seconds(loaded, batch: int, context: int, steps: int) -> float:
    """Mean wall time of one batched decode step (batch sequences, each `context` tokens long)."""
    from qrun.kv_cache import KVCache, KVCacheSpec
    from qrun.model import AttentionMetadata

    model = loaded.model
    block = 16
    blocks_per_seq = (context + steps + block - 1) // block
    cache = KVCache(model.config, batch * blocks_per_seq, block, KVCacheSpec(loaded.dtype), "cpu")
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq).tolist()
    times = []
    with torch.inference_mode():
        for step in range(steps):
            pos = context + step
            meta = AttentionMetadata.build([(pos, pos + 1)] * batch, tables, block)
            ids = torch.randint(0, model.config.vocab_size, (batch,))
            t0 = time.perf_counter()
            model.compute_logits(model(ids, torch.full((batch,), pos), meta, cache))
            times.append(time.perf_counter() - t0)
    times = sorted(times[1:])  # first step warms up (and prepares quantized layers)
    return times[len(times) // 2]


def speed(quant_dir: str, batches=(1, 8, 32), steps: int = 12) -> dict:
    from qrun.loader import load_model

    out = {}
    bf16 = load_model(MODEL, dtype="bfloat16", device="cpu")
    quant = load_model(quant_dir, dtype="bfloat16", device="cpu")
    for batch in batches:
        a = decode_seconds(bf16, batch, 128, steps)
        b = decode_seconds(quant, batch, 128, steps)
        out[batch] = {"bf16_ms": a * 1e3, "quant_ms": b * 1e3, "speedup": a / b}
        print(f"decode batch {batch:3d}: bf16 {a * 1e3:8.1f} ms/step, {quant_dir} {b * 1e3:8.1f} ms/step "
              f"({a / b:.2f}x)", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=float, nargs="*", default=[2.5, 3.0, 4.0, 4.65, 5.0])
    parser.add_argument("--measurement", default=None, help="reuse this measurement.json (skips measuring)")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--work", default="/tmp/qrun-bench", help="folder for converted models")
    parser.add_argument("--results", default=None, help="write results JSON here")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--uniform-bits", type=int, nargs="*", default=[2, 3, 4, 5],
                        help="widths of the uniform GPTQ and RTN baselines (group 128); mixed-bit is also "
                             "converted at exactly each uniform baseline's bpw")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a busy 2-core machine)")
    parser.add_argument("--ref-cache", default=None,
                        help="keep the reference's log-probabilities in this file, so parallel or later runs "
                             "over the same texts skip the reference pass")
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--speed-model", default=None, help="converted folder to time (default: the 4.0 one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from qrun.convert.main import convert
    from qrun.loader import load_model
    from qrun.perplexity import evaluate

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"preset": args.preset, "max_tokens": args.max_tokens, "rows": []}
    if args.speed_only:
        results["speed"] = speed(args.speed_model or str(work / f"mixed-4.0-{args.preset}"))
        print(json.dumps(results["speed"]))
        return 0

    texts = held_out()
    ref = load_model(MODEL, dtype="float32", device="cpu")

    def score(label: str, model, bpw: float, extra: dict | None = None) -> None:
        t0 = time.time()
        r = evaluate(model, texts, ctx=512, max_tokens=args.max_tokens, ref=ref, ref_cache=ref_cache)
        row = {"method": label, "bpw": round(bpw, 4), "kl": r["kl"], "ppl": r["ppl"], "tokens": r["tokens"],
               "eval_s": round(time.time() - t0, 1), **(extra or {})}
        results["rows"].append(row)
        print(f"{label:28s} {bpw:7.3f} bpw   KL {r['kl']:.4f}   ppl {r['ppl']:.3f}", flush=True)
        if args.results:
            atomic_write_text(args.results, json.dumps(results, indent=1))

    ref_file = Path(args.ref_cache) if args.ref_cache else None
    # Reference log-probs per window: the reference runs once (once ever with --ref-cache).
    ref_cache: dict = torch.load(ref_file) if ref_file and ref_file.is_file() else {}
    score("reference (Q4_1 dequantized)", ref, 32.0)
    if ref_file and not ref_file.is_file():
        torch.save(ref_cache, ref_file.with_suffix(".partial"))
        ref_file.with_suffix(".partial").rename(ref_file)
    measurement = Path(args.measurement) if args.measurement else None
    for target in args.targets:
        out = work / f"mixed-{target}-{args.preset}"
        t0 = time.time()
        summary = convert(MODEL, out, bits=target, preset=args.preset, force=True,
                          measurement=measurement, quiet=True)
        wall = time.time() - t0
        measurement = measurement or out / "measurement.json"
        print(f"converted {target} bpw in {wall:.0f} s (achieved {summary['achieved_bpw']:.4f}, "
              f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB so far)", flush=True)
        score(f"qrun mixed GPTQ @{target}", load_model(str(out), dtype="float32", device="cpu"),
              summary["achieved_bpw"], {"convert_s": round(wall, 1)})
    if not args.no_baselines and measurement is not None:
        for bits in args.uniform_bits:
            cand = f"{bits}b:g128"
            mfile = work / f"uniform-{bits}.measurement.json"
            bpw = uniform_measurement(Path(measurement), cand, mfile)
            if bpw is None:
                print(f"uniform GPTQ {cand}: not a candidate of this preset's measurement, skipped", flush=True)
                model, rtn_bpw = fake_quant_rtn(MODEL, bits)
                score(f"RTN {bits}b g128(64)", model, rtn_bpw)
                continue
            out = work / f"uniform-{bits}"
            # + 0.005: the optimizer rounds each block's bits up to its budget grid
            summary = convert(MODEL, out, bits=bpw + 0.005, preset=args.preset, force=True, measurement=mfile,
                              quiet=True)
            score(f"uniform GPTQ {cand}", load_model(str(out), dtype="float32", device="cpu"), summary["achieved_bpw"])
            model, rtn_bpw = fake_quant_rtn(MODEL, bits)
            score(f"RTN {bits}b g128(64)", model, rtn_bpw)
            del model
            out = work / f"mixed-at-uniform-{bits}"
            # Exactly the uniform model's bits: the optimizer never goes above its target.
            summary = convert(MODEL, out, bits=bpw, preset=args.preset, force=True, measurement=measurement,
                              quiet=True)
            score(f"qrun mixed GPTQ @{bpw:.3f}", load_model(str(out), dtype="float32", device="cpu"),
                  summary["achieved_bpw"])
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
