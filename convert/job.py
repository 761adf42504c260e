"""The conversion job: its temporary folder, resumable state, and the split of the source.

Everything a conversion produces lives in `<OUT parent>/.<OUT name>.qrun-partial/` until the
output is complete; `job.json` there records the arguments and the last finished step of each
stage, written atomically after each step, so a rerun with the same arguments resumes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qrun.atomic import atomic_path, atomic_write_text
from qrun.errors import QrunError
from qrun.loader import LAYER_TENSOR



class ConvertError(QrunError):
    """A conversion cannot proceed (bad arguments, output exists, quantization went wrong)."""


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def atomic_torch_save(obj, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


class Job:
    def __init__(self, out: Path, args_key: dict):
        self.out = Path(out)
        self.dir = self.out.parent / f".{self.out.name}.qrun-partial"
        self.key = hashlib.sha256(json.dumps(args_key, sort_keys=True).encode()).hexdigest()[:16]
        self.args_key = args_key
        self.state: dict = {}
        self.resumed = False

    @property
    def path(self) -> Path:
        return self.dir / "job.json"

    def open(self) -> None:
        """Resume the job in the temp folder if its arguments match, else start a fresh one."""
        if self.path.is_file():
            try:
                state = json.loads(self.path.read_text())
            except (json.JSONDecodeError, OSError):
                state = {}
            if state.get("key") == self.key:
                self.state, self.resumed = state, True
                return
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.state = {"key": self.key, "args": self.args_key}
        self.save()

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.state, indent=1))

    def get(self, key: str, default=None):
        return self.state.get(key, default)

    def set(self, key: str, value) -> None:
        self.state[key] = value
        self.save()

    def sub(self, name: str) -> Path:
        path = self.dir / name
        path.mkdir(exist_ok=True)
        return path


def layer_tensor_names(config) -> set[str]:
    """Names (within a layer) every decoder layer of `config` has."""
    names = set(_LAYER_PARTS)
    if config.attention_bias:
        names |= {f"self_attn.{p}_proj.bias" for p in "qkv"}
    if config.mlp_bias:
        names |= {f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")}
    return names


def split_source(tensors, config, folder: Path, progress=None) -> None:
    """Stream the source's tensors into one float32 safetensors file per decoder layer plus
    `other.safetensors`, so later stages read one layer at a time."""
    num_layers = config.num_layers
    expected = layer_tensor_names(config)
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
        if expected <= set(per_layer[index]):  # a complete layer goes to disk at once
            atomic_save(per_layer.pop(index), folder / f"layer_{index:04d}.safetensors")
    for index, tensors_ in per_layer.items():
        atomic_save(tensors_, folder / f"layer_{index:04d}.safetensors")
    missing = [i for i in range(num_layers) if not (folder / f"layer_{i:04d}.safetensors").is_file()]
    if missing:
        raise ConvertError(f"the source has no tensors for decoder layer {missing[0]}; is it complete?")
    atomic_save(other, folder / "other.safetensors")


_LAYER_PARTS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
def load_layer_tensors(folder: Path, index: int) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"layer_{index:04d}.safetensors"))


def load_other_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "other.safetensors"))
