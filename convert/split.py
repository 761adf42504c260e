"""Split stage: the source's tensors, streamed into one float32 file per decoder layer.

Later stages read one layer's file at a time, so a conversion holds one layer's weights (and the
non-layer tensors of `other.safetensors`), never the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file

from qrun.config import ModelConfig
from qrun.convert.forward import empty_layer
from qrun.convert.job import ConvertError, atomic_save
from qrun.loader import LAYER_TENSOR


def split_source(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, folder: Path,
                 progress: Callable[[str], None] | None = None) -> None:
    """Stream the source's tensors into one float32 safetensors file per decoder layer plus
    `other.safetensors`, so later stages read one layer at a time."""
    num_layers = config.num_layers
    # What build_layer loads: a layer with all of it is complete and can leave memory.
    expected = set(empty_layer(config).state_dict())
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    other: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        match = LAYER_TENSOR.match(name)
        if match is None:
            other[name.removeprefix("model.")] = tensor.float().contiguous()
            continue
        index, rest = int(match.group(1)), match.group(2)
        if rest.endswith("rotary_emb.inv_freq"):
            continue
        per_layer.setdefault(index, {})[rest] = tensor.float().contiguous()
        if progress:
            progress(name)
        if expected <= set(per_layer[index]):
            atomic_save(per_layer.pop(index), folder / f"layer_{index:04d}.safetensors")
    for index, tensors_ in per_layer.items():
        atomic_save(tensors_, folder / f"layer_{index:04d}.safetensors")
    missing = [i for i in range(num_layers) if not (folder / f"layer_{i:04d}.safetensors").is_file()]
    if missing:
        raise ConvertError(f"the source has no tensors for decoder layer {missing[0]}; is it complete?")
    atomic_save(other, folder / "other.safetensors")


def load_layer_tensors(folder: Path, index: int) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"layer_{index:04d}.safetensors"))


def load_other_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "other.safetensors"))
