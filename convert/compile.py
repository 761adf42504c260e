"""Compile stage: the last shard, index, config.json, tokenizer, measurement.json, then the rename.

The output is assembled in `<job dir>/final/` and moved to OUT with one rename, so OUT is
either absent (or the old output, without --force) or complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open

from qrun.atomic import atomic_write_text
from qrun.convert.job import atomic_save
from qrun.convert.quantize import shard_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model")


def write_other_shard(config, other: dict, head_tensors: dict | None, final_dir: Path) -> None:
    tensors = {}
    for name, tensor in other.items():
        if name == "lm_head.weight" and (config.tie_word_embeddings or head_tensors is not None):
            continue
        tensors[f"model.{name}" if name != "lm_head.weight" else name] = tensor.half()
    if head_tensors:
        tensors.update(head_tensors)
    total = config.num_layers + 1
    atomic_save(tensors, final_dir / shard_name(config.num_layers, total))


def write_index(final_dir: Path, total: int) -> int:
    weight_map, size = {}, 0
    for i in range(total):
        name = shard_name(i, total)
        with safe_open(str(final_dir / name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
        size += (final_dir / name).stat().st_size
    atomic_write_text(final_dir / "model.safetensors.index.json",
                      json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1))
    return size


def write_tokenizer(source, tokenizer, final_dir: Path) -> None:
    """The source's tokenizer files; a GGUF's tokenizer (built from its vocabulary) is saved."""
    if source.kind == "gguf":
        tokenizer.save(final_dir)
        return
    for name in TOKENIZER_FILES:
        if (source.path / name).is_file():
            shutil.copyfile(source.path / name, final_dir / name)


def write_config(hf_config: dict, quant_config: dict, final_dir: Path) -> None:
    config = dict(hf_config)
    config.pop("quantization_config", None)
    config["quantization_config"] = quant_config
    config["torch_dtype"] = "float16"
    atomic_write_text(final_dir / "config.json", json.dumps(config, indent=1))


def publish(final_dir: Path, out: Path, job_dir: Path, force: bool) -> None:
    """Move the complete output into place (replacing OUT with --force) and drop the job folder."""
    if out.exists():
        if not force:  # checked at the start too; OUT may have appeared since
            from qrun.convert.job import ConvertError

            raise ConvertError(f"{out} exists; pass --force to overwrite it (the finished output waits in {job_dir})")
        old = job_dir / "old-output"
        os.replace(out, old)
    os.replace(final_dir, out)
    shutil.rmtree(job_dir, ignore_errors=True)
