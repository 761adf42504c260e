"""The conversion job: its temporary folder, its resumable state, and atomic saves into it.

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
from safetensors.torch import save_file

from qrun.atomic import atomic_path, atomic_write_text
from qrun.errors import QrunError


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
