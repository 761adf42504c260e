"""Measurement pass: every candidate's cost on every block (attention, MLP) of every layer.

Inputs reach layer i through the full-precision layers before it. For each block and each
candidate the block's matrices are quantized with GPTQ and the block's output on the score
rows is compared with the full-precision output: its relative squared error, and the KL it
costs at the logits (second order, through the gradients of convert/sensitivity.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from qrun.atomic import atomic_write_text
from qrun.convert.forward import (BLOCKS, LayerRunner, Rows, block_linears, build_layer, empty_layer, linear_shapes,
                                  load_rows, new_hessians, relative_error, save_rows)
from qrun.convert.gptq import Candidate, QuantizedMatrix, drift_corrected, gptq_quantize_many
from qrun.convert.presets import Preset
from qrun.convert.sensitivity import block_gradients, load_block_gradients, predicted_kl
from qrun.convert.split import load_layer_tensors
from qrun.format import LAYER_INPUTS


def split_matrix(qm: QuantizedMatrix, sizes: list[int]) -> list[QuantizedMatrix]:
    """A GPTQ result for concatenated outputs -> one result per original matrix."""
    out, start = [], 0
    for n in sizes:
        out.append(qm.columns(slice(start, start + n), dataclasses.replace(qm.layout, out_features=n)))
        start += n
    return out


def quantize_input(layer, shared: str, cands: list[Candidate], h: torch.Tensor, clip_search: bool,
                   damp: float = 0.01, cross: torch.Tensor | None = None) -> list[dict[str, QuantizedMatrix]]:
    """GPTQ the matrices reading one shared input (as one matrix), under each candidate.

    With `cross` (the input drift's correlation, see gptq.drift_corrected) the target is the
    full-precision model's output rather than the layer's own unquantized output."""
    names = LAYER_INPUTS[shared]
    weights = [layer.get_submodule(n).weight.float() for n in names]
    w = torch.cat(weights)
    if cross is not None:
        w = drift_corrected(w, h, cross, damp)
    qms = gptq_quantize_many(w, h, cands, damp=damp, clip_search=clip_search)
    return [dict(zip(names, split_matrix(qm, [w.shape[0] for w in weights]))) for qm in qms]


def quantize_block_many(layer, block: str, cands: list[Candidate], hessians: dict, clip_search: bool,
                        damp: float = 0.01) -> list[dict[str, QuantizedMatrix]]:
    """Every matrix of a block under each candidate (one GPTQ sweep per compatible batch)."""
    results: list[dict[str, QuantizedMatrix]] = [{} for _ in cands]
    for shared in BLOCKS[block]:
        for result, part in zip(results, quantize_input(layer, shared, cands, hessians[shared], clip_search, damp)):
            result.update(part)
    return results


def block_bits(shapes: dict[str, tuple[int, int]], block: str, cand: Candidate) -> int:
    """Exact storage bits of a block's matrices under a candidate (`shapes`: forward.linear_shapes)."""
    return sum(cand.layout(k, n).storage_bits() for n, k in (shapes[name] for name in block_linears(block)))


def block_weights(shapes: dict[str, tuple[int, int]], block: str) -> int:
    return sum(n * k for n, k in (shapes[name] for name in block_linears(block)))


class swapped_weights:
    """Context manager: a layer's linears temporarily use the given dequantized weights."""

    def __init__(self, layer, quantized: dict[str, QuantizedMatrix]):
        self.layer, self.quantized, self.saved = layer, quantized, {}

    def __enter__(self):
        for name, qm in self.quantized.items():
            lin = self.layer.get_submodule(name)
            self.saved[name] = lin.weight.data
            lin.weight.data = qm.dequantized()
        return self.layer

    def __exit__(self, *exc):
        for name, w in self.saved.items():
            self.layer.get_submodule(name).weight.data = w


def measure_layer(layer, runner: LayerRunner, rows: Rows, preset: Preset, grads: dict[str, torch.Tensor],
                  on_candidate=None):
    """Measure every candidate on both blocks of one layer; returns (results, next rows)."""
    hessians = new_hessians(layer)
    shapes = linear_shapes(layer)
    nxt, kept = runner.run(layer, rows, {k: acc.add for k, acc in hessians.items()},
                           keep_inputs=preset.score_rows)
    h = {k: v.hessian() for k, v in hessians.items()}
    results = {}
    for block in ("attn", "mlp"):
        ref = runner.block_output(layer, block, kept[block])
        entries = []
        all_quantized = quantize_block_many(layer, block, preset.candidates, h, preset.clip_search)
        for cand, quantized in zip(preset.candidates, all_quantized):
            with swapped_weights(layer, quantized):
                out = runner.block_output(layer, block, kept[block])
            entries.append({"candidate": cand.name, "bits": block_bits(shapes, block, cand),
                            "error": relative_error(out, ref), "kl": predicted_kl(out - ref, grads[block])})
            if on_candidate:
                on_candidate()
        results[block] = entries
    return results, nxt


def run_measurement(job, config, runner: LayerRunner, rows: Rows, preset: Preset, src_dir: Path, other: dict,
                    progress) -> list[dict]:
    """The measurement stage (after the sensitivity pass), resumable per layer. Returns the per-block results."""
    mdir = job.sub("measure")
    if not job.get("sensitivity_done"):
        task = progress.stage("sensitivity", 2 * config.num_layers)
        score = Rows(rows.x[:preset.score_rows], None if rows.residual is None else rows.residual[:preset.score_rows])
        block_gradients(config, runner, score, other, src_dir, mdir, lambda: progress.advance(task))
        progress.finish(task)
        job.set("sensitivity_done", True)
    done = job.get("measure_done", -1)
    if done >= 0:
        rows = load_rows(mdir / f"state_{done:04d}.pt")
    per_step = 2 * len(preset.candidates)
    task = progress.stage("measure", config.num_layers * per_step, completed=(done + 1) * per_step)
    for i in range(done + 1, config.num_layers):
        progress.describe(task, f"measure layer {i + 1}/{config.num_layers}")
        layer = build_layer(config, load_layer_tensors(src_dir, i))
        t0 = time.time()
        results, rows = measure_layer(layer, runner, rows, preset, load_block_gradients(mdir, i),
                                      lambda: progress.advance(task))
        atomic_write_text(mdir / f"layer_{i:04d}.json", json.dumps({"time": time.time() - t0, **results}))
        save_rows(rows, mdir / f"state_{i:04d}.pt")  # named by layer: a kill never mismatches
        job.set("measure_done", i)
        (mdir / f"state_{i - 1:04d}.pt").unlink(missing_ok=True)
        del layer
    progress.finish(task)
    shapes = linear_shapes(empty_layer(config))
    blocks = []
    for i in range(config.num_layers):
        data = json.loads((mdir / f"layer_{i:04d}.json").read_text())
        for block in ("attn", "mlp"):
            blocks.append({"name": f"layers.{i}.{block}", "layer": i, "block": block,
                           "weights": block_weights(shapes, block), "results": data[block]})
    return blocks
