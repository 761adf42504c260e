"""Quantize pass: each layer with its chosen candidates, inputs through the quantized layers before it.

Two streams of calibration rows advance together: the quantized model's, which every matrix is
quantized on, and the full-precision model's, which every matrix aims at (see quantize_layer).
After quantizing a block its output error against the full-precision model is checked against
the drift its inputs carried plus its measured error; NaN or a wildly larger error stops the job.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from qrun.convert.forward import (LayerRunner, Rows, block_linears, build_layer, final_norm, load_rows, relative_error,
                                  save_rows)
from qrun.convert.gptq import Candidate, HessianAccumulator, QuantizedMatrix, drift_error, gptq_quantize
from qrun.convert.job import ConvertError, atomic_save
from qrun.convert.measure import quantize_input
from qrun.convert.presets import Preset
from qrun.convert.split import load_layer_tensors
from qrun.format import LAYER_INPUTS

WILD_FACTOR = 10.0
WILD_SLACK = 0.02


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def check_error(name: str, err: float, drift: float, measured: float | None) -> None:
    """err: the quantized block's output against the full-precision model's; drift: the same for
    the unquantized block on the quantized model's inputs (what the layers before caused)."""
    if not math.isfinite(err):
        raise ConvertError(f"{name}: quantized output is not finite (NaN/inf); the source weights or "
                           "calibration activations are broken")
    if measured is None:
        return
    expected = drift + measured
    if err > max(WILD_FACTOR * expected, expected + WILD_SLACK):
        raise ConvertError(f"{name}: output error {err:.4g} is far above the drift of its inputs ({drift:.4g}) "
                           f"plus its measured error ({measured:.4g}); stopping (rerun with --preset best or more "
                           "calibration text)")


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


def input_statistics(x: torch.Tensor, x_fp: torch.Tensor | None = None):
    """H = X_q X_q^T / T of a linear's inputs on the quantized model's stream (x [T, K]) and, given
    the full-precision model's (x_fp), the drift correlation D = (X_fp - X_q) X_q^T / T."""
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.hessian(), None if x_fp is None else (x_fp - x).T @ x / x.shape[0]


def quantize_layer(layer, runner: LayerRunner, rows: Rows, fp_rows: Rows | None, choice: dict[str, Candidate],
                   prefix: str, preset: Preset, measured: dict[str, float]):
    """GPTQ one layer's matrices in forward order along the quantized model's own stream.

    q/k/v first; then o_proj on the heads of the already quantized attention; then gate/up on
    the quantized attention block's output; then down_proj. Each sees the inputs the finished
    model will give it, and aims at the full-precision model's output on its own stream (rows of
    the full-precision model, `fp_rows`), so every matrix also corrects the drift of what came
    before. Without `fp_rows` (no drift correction) every matrix aims at its own unquantized
    output. Returns (quantized matrices, report entry, next rows, next fp rows or None)."""
    fp_next, fp_inputs = None, None
    if fp_rows is not None:
        captured: dict[str, list[torch.Tensor]] = {name: [] for name in LAYER_INPUTS}
        fp_next, _ = runner.run(layer, fp_rows, {name: xs.append for name, xs in captured.items()})
        fp_inputs = {name: torch.cat(xs) for name, xs in captured.items()}
        del captured
    qlayer = copy.deepcopy(layer)
    quantized: dict[str, QuantizedMatrix] = {}

    def quantize(block: str, shared: str, x: torch.Tensor) -> None:
        # The score rows are held out of the correction's fit and decide whether it helps; plain
        # GPTQ sees every row, which only biases that decision toward no correction.
        x = x.flatten(0, -2)
        held = preset.score_rows * runner.row_len if fp_inputs is not None else 0
        if held >= x.shape[0]:
            held = 0  # too few rows to hold any out: no correction
        cand = [choice[f"{prefix}.{block}"]]
        if not held:
            [result] = quantize_input(layer, shared, cand, input_statistics(x)[0], preset.clip_search)
        else:
            x_fp = fp_inputs[shared].flatten(0, -2)
            h_fit, cross = input_statistics(x[held:], x_fp[held:])
            h_held, cross_held = input_statistics(x[:held], x_fp[:held])
            h_all = (h_fit * (x.shape[0] - held) + h_held * held) / x.shape[0]
            options = (quantize_input(layer, shared, cand, h_all, preset.clip_search)[0],
                       quantize_input(layer, shared, cand, h_fit, preset.clip_search, cross=cross)[0])
            result = min(options, key=lambda r: sum(
                drift_error(layer.get_submodule(n).weight, qm.dequantized(), h_held, cross_held)
                for n, qm in r.items()))
        for name, qm in result.items():
            qlayer.get_submodule(name).weight.data = qm.dequantized()
        quantized.update(result)

    h, residual = qlayer.input_layernorm(rows.x, rows.residual)
    quantize("attn", "attn_in", h)
    heads = runner.chunked(lambda chunk: runner.heads(qlayer, chunk), h)
    quantize("attn", "attn_out", heads)
    h2, residual = qlayer.post_attention_layernorm(qlayer.self_attn.o_proj(heads), residual)
    quantize("mlp", "mlp_in", h2)
    act = qlayer.mlp.hidden(h2)
    quantize("mlp", "mlp_out", act)
    next_rows = Rows(qlayer.mlp.down_proj(act), residual)

    entry = {}
    for block, x, block_input in (("attn", h, "attn_in"), ("mlp", h2, "mlp_in")):
        name = f"{prefix}.{block}"
        score = x[:preset.score_rows]
        score_fp = score if fp_inputs is None else fp_inputs[block_input][:preset.score_rows]
        target = runner.block_output(layer, block, score_fp)
        err = relative_error(runner.block_output(qlayer, block, score), target)
        drift = 0.0 if fp_inputs is None else relative_error(runner.block_output(layer, block, score), target)
        check_error(name, err, drift, measured.get(name))
        parts = [quantized[n] for n in block_linears(block)]
        entry[block] = {"candidate": choice[name].name, "error": err, "drift": drift, "measured": measured.get(name),
                        "bits": sum(m.layout.storage_bits() for m in parts),
                        "weights": sum(m.layout.in_features * m.layout.out_features for m in parts)}
    return quantized, entry, next_rows, fp_next


def run_quantize(job, config, runner: LayerRunner, rows: Rows, preset: Preset, src_dir: Path,
                 choice: dict[str, Candidate], measured: dict[str, float], final_dir: Path, progress) -> list[dict]:
    """Quantize every layer (resumable per layer); returns the per-layer report."""
    qdir = job.sub("quantize")
    done = job.get("quantize_done", -1)
    report = job.get("report", [])
    fp_rows = rows if preset.correct_drift else None  # the full-precision model's stream
    if done >= 0:
        rows = load_rows(qdir / f"state_{done:04d}.pt")
        fp_rows = load_rows(qdir / f"fp_state_{done:04d}.pt") if preset.correct_drift else None
    total_shards = config.num_layers + 1
    task = progress.stage("quantize", config.num_layers, completed=done + 1)
    for i in range(done + 1, config.num_layers):
        progress.describe(task, f"quantize layer {i + 1}/{config.num_layers}")
        layer = build_layer(config, load_layer_tensors(src_dir, i))
        quantized, entry, rows, fp_rows = quantize_layer(layer, runner, rows, fp_rows, choice, f"layers.{i}", preset,
                                                         measured)
        atomic_save(layer_tensors(i, layer, quantized), final_dir / shard_name(i, total_shards))
        # Named by layer: a kill between the two saves never pairs states of different layers.
        if fp_rows is not None:
            save_rows(fp_rows, qdir / f"fp_state_{i:04d}.pt")
        save_rows(rows, qdir / f"state_{i:04d}.pt")
        report.append({"layer": i, **entry})
        job.state["report"] = report
        job.set("quantize_done", i)
        for stale in (f"state_{i - 1:04d}.pt", f"fp_state_{i - 1:04d}.pt"):
            (qdir / stale).unlink(missing_ok=True)
        progress.advance(task)
        del layer
    progress.finish(task)
    return report


def quantize_head(config, runner: LayerRunner, rows: Rows, other: dict, weight: torch.Tensor, head_bits: int,
                  preset: Preset):
    """GPTQ of the lm_head `weight` on the final-normed calibration states. Returns (tensors, layout)."""
    norm = final_norm(config, other)
    acc = HessianAccumulator(config.hidden_size)
    for start in range(0, rows.x.shape[0], runner.chunk_rows):
        res = None if rows.residual is None else rows.residual[start:start + runner.chunk_rows]
        h, _ = norm(rows.x[start:start + runner.chunk_rows], res)
        acc.add(h)
    w = weight.float()
    cand = Candidate(128, ((head_bits, 1.0),))
    qm = gptq_quantize(w, acc.hessian(), cand, clip_search=preset.clip_search)
    tensors = {f"lm_head.{k}": v for k, v in qm.tensors().items()}
    return tensors, qm.layout
