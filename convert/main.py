"""`qrun convert SRC OUT --bits B`: the conversion pipeline, stage by stage.

split (source -> one file per layer) -> calibration rows -> measure (or --measurement FILE)
-> optimize -> quantize -> compile (+ rename into OUT). Every stage is resumable from the
job file in the temporary folder; see convert/job.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from qrun.config import ModelConfig
from qrun.convert.calibration import calibration_rows, default_calibration_files
from qrun.convert.compile import (publish, write_config, write_index, write_other_shard, write_tokenizer)
from qrun.convert.forward import LayerRunner, Rows, block_linears, empty_layer, linear_shapes, load_rows
from qrun.convert.gptq import Candidate
from qrun.convert.job import ConvertError, Job
from qrun.convert.measure import block_bits, block_weights, run_measurement
from qrun.convert.optimize import bpw_range, optimize
from qrun.convert.presets import PRESETS
from qrun.convert.split import load_other_tensors, split_source
from qrun.format import BIT_WIDTHS, DEFAULT_HEAD_BITS, FORMAT_VERSION
from qrun.convert.quantize import quantize_head, run_quantize
from qrun.errors import ModelLoadError
from qrun.kernels.rotary import rotary_cos_sin

MAX_BPW = 8.0
MEASUREMENT_VERSION = 3


class Progress:
    """Stage / layer i of N / ETA on stderr (rich), or silent."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._progress = None
        if not quiet:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.console = Console(stderr=True)
            self._progress = RichProgress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                                          TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                          console=self.console)

    def __enter__(self):
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self._progress:
            self._progress.stop()

    def stage(self, name: str, total: int, completed: int = 0):
        if not self._progress:
            return None
        return self._progress.add_task(name, total=total, completed=completed)

    def describe(self, task, text: str) -> None:
        if self._progress and task is not None:
            self._progress.update(task, description=text)

    def advance(self, task, n: int = 1) -> None:
        if self._progress and task is not None:
            self._progress.advance(task, n)

    def finish(self, task) -> None:
        if self._progress and task is not None:
            self._progress.update(task, completed=self._progress.tasks[task].total)

    def log(self, text: str) -> None:
        if self._progress:
            self._progress.console.print(text)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="model to convert: HF folder, hub id, .gguf file or alias (never modified)")
    parser.add_argument("out", help="output folder (written via a temporary folder, renamed when complete)")
    parser.add_argument("--bits", type=float, required=True, help="target bits per weight of the decoder layers")
    parser.add_argument("--head-bits", type=int, default=DEFAULT_HEAD_BITS,
                        help=f"bits of lm_head (default {DEFAULT_HEAD_BITS}); a head tied to the embedding is stored untied")
    parser.add_argument("--calib", nargs="+", metavar="FILE",
                        help="calibration text: .txt, .jsonl (text field) or .parquet (text column); "
                             "default: shared/data/text/brown_[a-j]*.txt")
    parser.add_argument("--calib-rows", type=int, help="calibration rows (default: by preset)")
    parser.add_argument("--calib-len", type=int, help="tokens per calibration row (default: by preset)")
    parser.add_argument("--measurement", metavar="FILE", help="reuse a measurement.json instead of measuring")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="fast: few candidates, little calibration; best: more of both")
    parser.add_argument("--quiet", action="store_true", help="no progress display or summary table")


def run_convert(args: argparse.Namespace) -> int:
    summary = convert(args.src, args.out, bits=args.bits, head_bits=args.head_bits, calib=args.calib,
                      calib_rows=args.calib_rows, calib_len=args.calib_len, measurement=args.measurement,
                      force=args.force, preset=args.preset, quiet=getattr(args, "quiet", False))
    return 0 if summary else 1


def _validate(bits: float, head_bits: int, out: Path, src_path: Path, force: bool, calib_rows, calib_len) -> None:
    if not bits == bits or bits > MAX_BPW:
        raise ConvertError(f"--bits {bits} is above {MAX_BPW:g}; choose a target between ~2.3 and 8")
    if bits <= 0:
        raise ConvertError(f"--bits {bits} must be positive")
    if head_bits not in BIT_WIDTHS:
        raise ConvertError(f"--head-bits {head_bits} is not one of {', '.join(map(str, BIT_WIDTHS))}")
    if out.exists() and not force:
        raise ConvertError(f"{out} exists; pass --force to overwrite it")
    if out.resolve() == src_path.resolve():
        raise ConvertError("OUT is the source; the source is never modified, choose another folder")
    if calib_rows is not None and calib_rows < 1:
        raise ConvertError("--calib-rows must be at least 1")
    if calib_len is not None and calib_len < 16:
        raise ConvertError("--calib-len must be at least 16 tokens")


def _load_measurement(path: Path, config) -> tuple[list[dict], list[Candidate]]:
    try:
        data = json.loads(Path(path).read_text())
        blocks = data["blocks"]
        cands = [Candidate.from_json(c) for c in data["candidates"]]
    except FileNotFoundError:
        raise ConvertError(f"measurement file {path} does not exist") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"measurement file {path} is malformed ({err})") from None
    if data.get("version") != MEASUREMENT_VERSION:
        raise ConvertError(f"measurement file {path} is version {data.get('version')}; this qrun reads version "
                           f"{MEASUREMENT_VERSION} (its bit counts predate 8-bit group scales): "
                           "measure again without --measurement")
    if len(blocks) != 2 * config.num_layers:
        raise ConvertError(f"measurement file {path} has {len(blocks)} blocks; this model has {2 * config.num_layers}")
    return blocks, cands


def convert(src, out, *, bits: float, head_bits: int = DEFAULT_HEAD_BITS, calib=None, calib_rows=None, calib_len=None,
            measurement=None, force: bool = False, preset: str = "default", quiet: bool = True) -> dict:
    """Convert `src` into a quantized folder `out`; returns the summary (also in config.json)."""

    start = time.time()
    torch.manual_seed(0)
    # All cores by default (on an idle 2-core machine 2 threads convert ~1.2x faster than 1). GPTQ
    # is thousands of small ops, and when other work holds a core each of them waits for a
    # descheduled thread: QRUN_CONVERT_THREADS=1 is then several times faster.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("QRUN_CONVERT_THREADS", threads_before)))
    try:
        return _convert(src, out, start, bits=bits, head_bits=head_bits, calib=calib, calib_rows=calib_rows,
                        calib_len=calib_len, measurement=measurement, force=force, preset=preset, quiet=quiet)
    finally:
        torch.set_num_threads(threads_before)


def _convert(src, out, start, *, bits, head_bits, calib, calib_rows, calib_len, measurement, force, preset,
             quiet) -> dict:
    from qrun.loader import _source_parts
    from qrun.sources import resolve

    out = Path(out).expanduser().absolute()
    if preset not in PRESETS:
        raise ConvertError(f"unknown preset {preset!r}; choose {', '.join(PRESETS)}")
    chosen_preset = PRESETS[preset]
    source = resolve(src)
    _validate(bits, head_bits, out, source.path, force, calib_rows, calib_len)
    hf_config, tensors, make_tokenizer, _ = _source_parts(source)
    if "quantization_config" in hf_config:
        raise ModelLoadError(f"{src} is already quantized; convert from the original weights")
    config = ModelConfig.from_hf(hf_config)
    rows_n = calib_rows or chosen_preset.rows
    row_len = min(calib_len or chosen_preset.row_len, config.max_model_len)
    calib_files = [Path(f) for f in calib] if calib else default_calibration_files()

    candidates = list(chosen_preset.candidates)
    measured_blocks = None
    if measurement:
        measured_blocks, candidates = _load_measurement(Path(measurement), config)
    by_name = {c.name: c for c in candidates}
    # Bits range from shapes alone: reject impossible targets before any work.
    shapes = linear_shapes(empty_layer(config))
    shape_blocks = [{"weights": block_weights(shapes, b),
                     "results": [{"bits": block_bits(shapes, b, c)} for c in candidates]}
                    for _ in range(config.num_layers) for b in ("attn", "mlp")]
    low, high = bpw_range(shape_blocks)
    if bits < low - 1e-9:
        raise ConvertError(f"--bits {bits} is below the smallest achievable {low:.3f} bpw for this model "
                           f"(its cheapest candidate everywhere)")

    # Tokenize before the job starts: bad calibration input fails fast and leaves nothing behind.
    tokenizer = make_tokenizer(list(config.eos_token_ids))
    tokens, calib_summary = calibration_rows(calib_files, tokenizer, rows_n, row_len)
    row_len = tokens.shape[1]

    job = Job(out, {"src": str(source.path), "bits": bits, "head_bits": head_bits,
                    "calib": [str(Path(f).resolve()) for f in calib_files], "rows": rows_n, "len": row_len,
                    "preset": preset, "measurement": str(Path(measurement).resolve()) if measurement else None})
    job.open()
    final_dir = job.sub("final")
    src_dir = job.sub("source")
    with Progress(quiet) as progress:
        if job.resumed:
            progress.log(f"resuming the conversion in {job.dir}")
        if not job.get("split_done"):
            task = progress.stage("read source", config.num_layers * 9)
            split_source(tensors(), config, src_dir, lambda name: progress.advance(task))
            progress.finish(task)
            job.set("split_done", True)
        other = load_other_tensors(src_dir)
        embed = other["embed_tokens.weight"]
        cos_sin = rotary_cos_sin(config.rope_inv_freq(), config.max_model_len, torch.device("cpu"))
        runner = LayerRunner(config, cos_sin, row_len, chunk_rows=max(1, 4096 // row_len))
        start_rows = Rows(embed[tokens], None)

        if measured_blocks is None:
            measured_blocks = run_measurement(job, config, runner, start_rows, chosen_preset, src_dir, other,
                                              progress)
        measurement_doc = {"version": MEASUREMENT_VERSION, "source": str(src), "calibration": calib_summary, "preset": preset,
                           "candidates": [c.to_json() for c in candidates], "blocks": measured_blocks}

        picked, achieved = optimize(measured_blocks, bits)
        if achieved < bits - 0.01 and bits <= bpw_range(measured_blocks)[1]:
            progress.log(f"note: achieved {achieved:.3f} bpw, more than 0.01 under the target {bits}")
        choice = {b["name"]: by_name[name] for b, name in zip(measured_blocks, picked)}
        chosen = [next(r for r in b["results"] if r["candidate"] == name) for b, name in zip(measured_blocks, picked)]
        measured_err = {b["name"]: r["error"] for b, r in zip(measured_blocks, chosen)}
        predicted_kl = sum(r["kl"] for r in chosen)

        report = run_quantize(job, config, runner, start_rows, chosen_preset, src_dir, choice, measured_err,
                              final_dir, progress)
        head_tensors, head_layout = None, None
        # A tied head is quantized too and stored untied: it is the largest matrix a decode step
        # reads (SmolLM2: 49152 x 576), while the embedding only gathers rows and stays float16.
        head_weight = other["embed_tokens.weight"] if config.tie_word_embeddings else other.get("lm_head.weight")
        if head_weight is not None:
            rows = load_rows(job.dir / "quantize" / f"state_{config.num_layers - 1:04d}.pt")
            head_tensors, head_layout = quantize_head(config, runner, rows, other, head_weight, head_bits,
                                                      chosen_preset)
        write_other_shard(config, other, head_tensors, final_dir)
        file_bytes = write_index(final_dir, config.num_layers + 1)
        modules = {}
        for entry in report:
            for block in ("attn", "mlp"):
                cand = choice[f"layers.{entry['layer']}.{block}"]
                for name in block_linears(block):
                    n, k = shapes[name]
                    modules[f"model.layers.{entry['layer']}.{name}"] = cand.layout(k, n).to_json()
        if head_layout is not None:
            modules["lm_head"] = head_layout.to_json()
        total_bits = sum(e[b]["bits"] for e in report for b in ("attn", "mlp"))
        total_weights = sum(e[b]["weights"] for e in report for b in ("attn", "mlp"))
        quant_config = {
            "quant_method": "qrun-exl", "version": FORMAT_VERSION, "target_bpw": bits,
            "achieved_bpw": round(total_bits / total_weights, 5), "predicted_kl": round(predicted_kl, 5),
            "head_bits": head_bits,
            "head_bpw": round(head_layout.bpw(), 5) if head_layout else None,
            "calibration": calib_summary, "preset": preset, "file_bytes": file_bytes, "modules": modules,
        }
        write_config({**hf_config, "tie_word_embeddings": False} if head_layout else hf_config, quant_config,
                     final_dir)
        write_tokenizer(source, tokenizer, final_dir)
        (final_dir / "measurement.json").write_text(json.dumps(measurement_doc, indent=1))
        publish(final_dir, out, job.dir, force)
    wall = time.time() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary = {"out": str(out), "target_bpw": bits, "achieved_bpw": quant_config["achieved_bpw"],
               "predicted_kl": quant_config["predicted_kl"],
               "wall_s": round(wall, 1), "peak_rss_bytes": peak_rss, "report": report, "resumed": job.resumed}
    if not quiet:
        _print_table(summary)
    return summary


def _print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"qrun convert → {summary['out']}")
    for col in ("layer", "attn bits", "attn err vs fp (measured)", "mlp bits", "mlp err vs fp (measured)",
                "layer bpw"):
        table.add_column(col, justify="right" if "err" in col or col in ("layer", "layer bpw") else "left",
                         no_wrap=True)
    for e in summary["report"]:
        a, m = e["attn"], e["mlp"]
        bpw = (a["bits"] + m["bits"]) / (a["weights"] + m["weights"])
        table.add_row(str(e["layer"]), a["candidate"], f"{a['error']:.2e} ({a['measured']:.2e})",
                      m["candidate"], f"{m['error']:.2e} ({m['measured']:.2e})", f"{bpw:.3f}")
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=160)
    console.print(table)
    console.print(f"target {summary['target_bpw']} bpw, achieved {summary['achieved_bpw']:.4f} bpw, "
                  f"predicted KL {summary['predicted_kl']:.4f} nats/token (calibration rows); "
                  f"wall {summary['wall_s']:.1f} s; peak RSS {summary['peak_rss_bytes'] / 2**30:.2f} GiB")


def main(argv=None) -> int:
    """`python -m qrun.convert.main ...` is `qrun convert ...`, errors and exit codes included."""
    import sys

    from qrun.cli import main as qrun_main

    return qrun_main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
