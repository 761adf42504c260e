"""GPTQModel 4-bit / 3-bit group-128 baseline for the converter's quality table (issue 4).

GPTQModel quantizes SmolLM2-135M on this CPU, but its CPU int4 kernel rejects K=576 with group
128, so its checkpoint is unpacked here into a dense float32 Hugging Face folder and scored by
`qrun ppl` like every other model. Three steps, in two Python environments:

1. `export-source` (qrun's environment): the reference model qrun evaluates against (the Q4_1
   GGUF of `smollm2-135m`, dequantized, q/k permutation undone) as a plain float32 HF folder,
   checked against qrun's own forward pass with transformers.
2. `quantize` (GPTQModel's own venv): GPTQModel with its defaults (sym, desc_act off, its
   act-group-aware ordering), float32, calibrated on qrun's default calibration text
   (`brown_[a-j]*.txt`, rows cut as `qrun.convert.calibration.calibration_rows` cuts them;
   never the held-out brown_k / brown_l).
3. `unpack` (either environment): GPTQModel's qweight/qzeros/scales/g_idx to dense float32
   weights, and the checkpoint's bits per weight over the decoder linears from the bytes of
   those four tensors.

Setup of GPTQModel's venv (torch first and pinned: an unpinned torch pulls CUDA builds; the
gptqmodel sdist builds no extension at install time):

    python3 -m venv /tmp/gptqmodel-venv
    /tmp/gptqmodel-venv/bin/pip install torch==2.13.0
    /tmp/gptqmodel-venv/bin/pip install gptqmodel==7.6.0 torch==2.13.0

Run from the repository root (one heavy job at a time on a shared machine):

    python scripts/gptqmodel_baseline.py export-source /tmp/gptqm/src
    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqmodel-venv/bin/python scripts/gptqmodel_baseline.py \\
        quantize /tmp/gptqm/src /tmp/gptqm/w4g128 --bits 4 --group-size 128
    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqmodel-venv/bin/python scripts/gptqmodel_baseline.py \\
        quantize /tmp/gptqm/src /tmp/gptqm/w3g128 --bits 3 --group-size 128
    python scripts/gptqmodel_baseline.py unpack /tmp/gptqm/w4g128 /tmp/gptqm/w4g128-dense
    python scripts/gptqmodel_baseline.py unpack /tmp/gptqm/w3g128 /tmp/gptqm/w3g128-dense
    python -m qrun.cli ppl /tmp/gptqm/w4g128-dense --text ../shared/data/text/brown_k*.txt \\
        ../shared/data/text/brown_l*.txt --ctx 512 --max-tokens 8192 --ref smollm2-135m --json

(and the same `ppl` line for w3g128-dense). `quantize` writes `baseline_quantize.json`
(calibration, wall time, versions) beside GPTQModel's checkpoint; `unpack` prints and writes
`baseline_unpack.json` (bpw, bytes, weights) into the dense folder.

Measured here (gptqmodel 7.6.0, transformers 5.24.0, torch 2.13.0+cpu; calibration 128 rows x 512
tokens of brown_[a-j]; first 8192 tokens of brown_k + brown_l, 16352 scored tokens; the dense
export itself scores ppl 40.143, KL 0 against smollm2-135m; quantization wall time on the shared
2-core machine with another CPU job running):

| GPTQModel | bpw (decoder linears) | KL(ref ‖ model) | ppl | quantize wall |
| --- | --- | --- | --- | --- |
| 4-bit g128 sym | 4.2144 | 0.2599 | 51.16 | 1667 s |
| 3-bit g128 sym | 3.2059 | 1.0609 | 105.69 | 1712 s |
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# As `import qrun` does: OpenMP threads that spin between ops starve Python on a busy 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if TYPE_CHECKING:
    from qrun.loader import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
CALIB_DIR = ROOT.parent / "shared" / "data" / "text"
CALIB_GLOB = "brown_[a-j]*.txt"  # qrun.convert.calibration.DEFAULT_GLOB
HELD_OUT = ("brown_k", "brown_l")  # qrun.convert.calibration.HELD_OUT
CHECK_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is"
CHECK_TOLERANCE = 1e-3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def export_source(out: Path, model: str) -> None:
    """Write `model` as loaded by qrun (float32) as an HF folder and check transformers agrees."""
    from safetensors.torch import save_file

    from qrun.convert.compile import write_tokenizer
    from qrun.loader import load_model

    loaded = load_model(model, dtype="float32", device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    # named_parameters() lists a tied lm_head once, as embed_tokens; HF ties it back from the config.
    tensors = {f"model.{name}": p.detach().contiguous() for name, p in loaded.model.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(loaded.hf_config, torch_dtype="float32"), indent=1))
    write_tokenizer(loaded.source, out)
    diff = check_export(loaded, out)
    print(json.dumps({"out": str(out), "tensors": len(tensors), "max_abs_logprob_diff": diff}))
    if diff >= CHECK_TOLERANCE:
        sys.exit(f"transformers' log-probabilities differ from qrun's by {diff:.2e} (>= {CHECK_TOLERANCE})")


def check_export(loaded: LoadedModel, folder: Path) -> float:
    """Max |log-softmax| difference between qrun's model and transformers on `folder`."""
    from transformers import AutoModelForCausalLM

    from qrun.perplexity import window_logprobs

    ids = torch.tensor(loaded.tokenizer.encode(CHECK_PROMPT, add_special_tokens=False), dtype=torch.long)
    ours = window_logprobs(loaded.model, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = hf(ids[None]).logits[0].float().log_softmax(-1)
    return (ours - theirs).abs().max().item()


def calibration_rows(files: list[Path], tokenizer_file: Path, rows: int, row_len: int) -> tuple[torch.Tensor, dict]:
    """[R, L] token ids cut exactly as qrun.convert.calibration.calibration_rows cuts them.

    Runs in GPTQModel's venv, where qrun is not installed; qrun's Tokenizer is this same
    tokenizers.Tokenizer built from tokenizer.json, encoding without special tokens.
    """
    from tokenizers import Tokenizer

    for f in files:
        if f.name.startswith(HELD_OUT):
            sys.exit(f"{f} is held-out evaluation text; never calibrate on it")
    text = "\n\n".join(t for t in (f.read_text(encoding="utf-8") for f in files) if t.strip())
    ids = Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids
    available = len(ids) // row_len
    count = min(rows, available)
    if count < 1:
        sys.exit(f"the calibration text has {len(ids)} tokens, fewer than one row of {row_len}")
    stride = available // count
    table = torch.tensor(ids[: available * row_len], dtype=torch.long).view(available, row_len)
    summary = {"files": [f.name for f in files], "rows": count, "row_len": row_len,
               "tokens": count * row_len, "text_tokens": len(ids)}
    return table[torch.arange(count) * stride], summary


def quantize(src: Path, out: Path, bits: int, group_size: int, rows: int, row_len: int, calib_dir: Path) -> None:
    """GPTQModel (defaults apart from bits and group size), float32 on the CPU, saved to `out`."""
    if os.environ.get("GPTQMODEL_CPU_WORKERS") is None:
        sys.exit("set GPTQMODEL_CPU_WORKERS (2 on this machine) before running quantize")
    import gptqmodel
    from gptqmodel import GPTQModel, QuantizeConfig

    files = sorted(calib_dir.glob(CALIB_GLOB))
    if not files:
        sys.exit(f"no {CALIB_GLOB} under {calib_dir}")
    ids, calib = calibration_rows(files, src / "tokenizer.json", rows, row_len)
    config = QuantizeConfig(bits=bits, group_size=group_size)
    start = time.perf_counter()
    model = GPTQModel.load(str(src), config, dtype=torch.float32, device="cpu")
    model.quantize([{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in ids],
                   batch_size=1)
    model.save(str(out))
    wall = time.perf_counter() - start
    summary = {"bits": bits, "group_size": group_size, "quantize_config": repr(config), "calibration": calib,
               "wall_s": round(wall, 1), "gptqmodel": gptqmodel.__version__, "torch": torch.__version__,
               "GPTQMODEL_CPU_WORKERS": os.environ["GPTQMODEL_CPU_WORKERS"], "threads": torch.get_num_threads()}
    (out / "baseline_quantize.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "quantize_config"}))


def unpack_bitstream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` `bits`-wide unsigned values of each row of int32 `words`, read as one
    LSB-first bit string (bit i of word j is bit 32*j + i; value v at bits v*bits ...).

    This is GPTQModel's non-planar layout for 2/4/8 bits (value i of a word at bits i*bits) and
    for 3 bits (32 values in 3 words: 10 | 1 straddling | 10 | 1 straddling | 10, see
    `PackableQuantLinear.pack_block` / `model_dequant._unpack_rows_3bit`).
    """
    rows = words.shape[0]
    octets = words.contiguous().view(torch.uint8)  # little-endian: low byte first
    bit = (octets.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    bit = bit.reshape(rows, -1)[:, : count * bits].reshape(rows, count, bits).to(torch.int32)
    return (bit << torch.arange(bits, dtype=torch.int32)).sum(-1, dtype=torch.int32)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bits: int, zero_offset: int) -> torch.Tensor:
    """Dense float32 weight [N out, K in]: w[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k]."""
    out_features = scales.shape[1]
    in_features = g_idx.shape[0]
    q = unpack_bitstream(qweight.t(), bits, in_features)  # [N, K]
    zeros = (unpack_bitstream(qzeros, bits, out_features) + zero_offset) & ((1 << bits) - 1)  # [G, N]
    group = g_idx.long()
    return scales.float()[group].t() * (q - zeros[group].t()).float()


def unpack(src: Path, out: Path) -> None:
    """GPTQModel checkpoint -> dense float32 HF folder, plus its bpw over the decoder linears."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    qcfg = config.pop("quantization_config")
    bits = int(qcfg["bits"])
    fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
    if qcfg.get("quant_method") != "gptq" or bits not in (2, 3, 4, 8) or fmt not in ("gptq", "gptq_v2"):
        sys.exit(f"unsupported GPTQModel checkpoint: quant_method {qcfg.get('quant_method')!r}, "
                 f"bits {bits}, format {fmt!r} (handled: gptq / gptq_v2, 2/3/4/8 bits, non-planar)")
    zero_offset = 1 if fmt == "gptq" else 0  # v1 checkpoints store every zero point minus one

    raw: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            raw.update((name, shard.get_tensor(name)) for name in shard.keys())
    prefixes = sorted({name.rsplit(".", 1)[0] for name in raw if name.endswith(".qweight")})
    tensors = {name: t.float().contiguous() for name, t in raw.items()
               if not name.endswith(PACKED_SUFFIXES)}
    packed_bytes = weights = 0
    for prefix in prefixes:
        parts = [raw[prefix + suffix] for suffix in PACKED_SUFFIXES]
        weight = dequantize(*parts, bits=bits, zero_offset=zero_offset)
        tensors[prefix + ".weight"] = weight.contiguous()
        if ".layers." in prefix:
            packed_bytes += sum(t.numel() * t.element_size() for t in parts)
            weights += weight.numel()

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    summary = {"source": str(src), "bits": bits, "group_size": qcfg.get("group_size"), "sym": qcfg.get("sym"),
               "desc_act": qcfg.get("desc_act"), "format": fmt, "quantized_linears": len(prefixes),
               "decoder_linear_weights": weights, "decoder_linear_bytes": packed_bytes,
               "bpw": round(8 * packed_bytes / weights, 4) if weights else None}
    (out / "baseline_unpack.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("export-source", help="qrun's float32 source model as an HF folder (qrun's env)")
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="smollm2-135m")
    p = commands.add_parser("quantize", help="quantize an HF folder with GPTQModel (GPTQModel's venv)")
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--bits", type=int, choices=(3, 4), required=True)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--calib-rows", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--calib-dir", type=Path, default=CALIB_DIR)
    p = commands.add_parser("unpack", help="GPTQModel checkpoint to a dense float32 HF folder (either env)")
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "export-source":
        export_source(args.out, args.model)
    elif args.command == "quantize":
        quantize(args.src, args.out, args.bits, args.group_size, args.calib_rows, args.calib_len, args.calib_dir)
    else:
        unpack(args.src, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
