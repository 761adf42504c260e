"""Quantize pass: each layer with its chosen candidates, inputs through the quantized layers before it.

After quantizing a block its output error (against the full-precision block on the same
inputs) is checked against the measured one; NaN or a wildly larger error stops the job.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from qrun.convert.forward import (LayerRunner, Rows, build_layer, final_norm, load_rows, new_hessians, relative_error,
                                  save_rows)
from qrun.convert.gptq import Candidate, HessianAccumulator, gptq_quantize
from qrun.convert.job import ConvertError, atomic_save, load_layer_tensors
from qrun.convert.measure import Preset, quantize_block, swapped_weights

WILD_FACTOR = 10.0
WILD_SLACK = 0.02


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def check_error(name: str, err: float, measured: float | None) -> None:
    if not math.isfinite(err):
        raise ConvertError(f"{name}: quantized output is not finite (NaN/inf); the source weights or "
                           "calibration activations are broken")
    if measured is not None and err > max(WILD_FACTOR * measured, measured + WILD_SLACK):
        raise ConvertError(f"{name}: output error {err:.4g} is far above its measured {measured:.4g}; "
                           "stopping (rerun with --preset best or more calibration text)")


def layer_tensors(i: int, layer, quantized: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in layer.named_parameters():
        module_name = name.rpartition(".")[0]
        if module_name in quantized and name.endswith(".weight"):
            continue
        out[f"model.layers.{i}.{name}"] = param.detach().half()
    for module_name, qm in quantized.items():
        for suffix, tensor in qm.tensors().items():
            out[f"model.layers.{i}.{module_name}.{suffix}"] = tensor
    return out


def run_quantize(job, config, runner: LayerRunner, rows: Rows, preset: Preset, src_dir: Path,
                 choice: dict[str, Candidate], measured: dict[str, float], final_dir: Path, progress) -> list[dict]:
    """Quantize every layer (resumable per layer); returns the per-layer report."""
    qdir = job.sub("quantize")
    done = job.get("quantize_done", -1)
    report = job.get("report", [])
    if done >= 0:
        rows = load_rows(qdir / f"state_{done:04d}.pt")
    total_shards = config.num_layers + 1
    task = progress.stage("quantize", config.num_layers, completed=done + 1)
    for i in range(done + 1, config.num_layers):
        progress.describe(task, f"quantize layer {i + 1}/{config.num_layers}")
        layer = build_layer(config, load_layer_tensors(src_dir, i))
        hessians = new_hessians(config)
        _, kept = runner.run(layer, rows, hessians, keep_inputs=preset.score_rows)
        h = {k: v.hessian() for k, v in hessians.items()}
        quantized, entry = {}, {"layer": i}
        for block in ("attn", "mlp"):
            name = f"layers.{i}.{block}"
            cand = choice[name]
            q = quantize_block(layer, block, cand, h, preset.clip_search)
            ref = runner.block_output(layer, block, kept[block])
            with swapped_weights(layer, q):
                err = relative_error(runner.block_output(layer, block, kept[block]), ref)
            check_error(name, err, measured.get(name))
            quantized.update(q)
            entry[block] = {"candidate": cand.name, "error": err, "measured": measured.get(name),
                            "bits": sum(m.layout.storage_bits() for m in q.values()),
                            "weights": sum(m.layout.in_features * m.layout.out_features for m in q.values())}
        with swapped_weights(layer, quantized):
            rows, _ = runner.run(layer, rows)
        atomic_save(layer_tensors(i, layer, quantized), final_dir / shard_name(i, total_shards))
        save_rows(rows, qdir / f"state_{i:04d}.pt")  # named by layer: a kill never mismatches
        report.append(entry)
        job.state["report"] = report
        job.set("quantize_done", i)
        (qdir / f"state_{i - 1:04d}.pt").unlink(missing_ok=True)
        progress.advance(task)
        del layer
    progress.finish(task)
    return report


def quantize_head(config, runner: LayerRunner, rows: Rows, other: dict, head_bits: int, preset: Preset):
    """GPTQ of an untied lm_head on the final-normed calibration states. Returns (tensors, info)."""
    norm = final_norm(config, other)
    acc = HessianAccumulator(config.hidden_size)
    for start in range(0, rows.x.shape[0], runner.chunk_rows):
        res = None if rows.residual is None else rows.residual[start:start + runner.chunk_rows]
        h, _ = norm(rows.x[start:start + runner.chunk_rows], res)
        acc.add(h)
    w = other["lm_head.weight"].float()
    cand = Candidate(128, ((head_bits, 1.0),))
    qm = gptq_quantize(w, acc.hessian(), cand, clip_search=preset.clip_search)
    tensors = {f"lm_head.{k}": v for k, v in qm.tensors().items()}
    return tensors, qm.layout
