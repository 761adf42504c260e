"""Building a ready-to-run model and tokenizer from any model source.

Weights stream in one tensor at a time onto a model built on the meta device, so loading
never holds two full copies of the weights.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from qrun.config import ModelConfig
from qrun.cpu_gemv import half_gemv_applies, use_half_gemv
from qrun.errors import ModelLoadError
from qrun.model import Transformer
from qrun.sources import ModelSource, resolve
from qrun.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint entries that carry no weights of ours (precomputed RoPE tables in old exports).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource
    hf_config: dict

    @property
    def device(self) -> torch.device:
        return self.model.cos_sin.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA GPU is available; use --device cpu")
    return device


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX), per /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on GPUs that support it (fp16 on older ones); on the CPU bfloat16 where
    the CPU has native bfloat16 arithmetic, else float32.

    A CPU decode step reads every weight once, so half the bytes is up to twice the speed: at
    batch 1 SmolLM2 in bfloat16 ran 1.7x float32 on an AVX512-BF16 CPU. Without native support
    bfloat16 matmuls are emulated and lose to float32.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json; is this a Hugging Face model folder?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err}); re-download the model") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object; re-download the model")
    return config


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelLoadError(f"{index} is malformed ({err}); re-download the model") from None
        files = [folder / shard for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks weight shards {', '.join(missing)} named by its index")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (other weight formats are not supported)")
    return files


def _read_shards(folder: Path, read: Callable[[Any], Iterable]) -> Iterator:
    """What `read(shard)` yields for each open weight file of `folder`; a damaged file (found on
    opening or while reading) is a ModelLoadError naming it."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as shard:
                yield from read(shard)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ModelLoadError(f"{file} is truncated or corrupt ({err}); re-download it") from None


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    return _read_shards(folder, lambda shard: ((name, shard.get_tensor(name)) for name in shard.keys()))


def safetensors_names(folder: Path) -> list[str]:
    return list(_read_shards(folder, lambda shard: shard.keys()))


# A decoder layer's tensor, as checkpoints name it: (layer index, the name within the layer).
LAYER_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def check_layer_count(config: ModelConfig, tensor_names: list[str], where: str) -> None:
    """Fail fast when the config's layer count disagrees with the weights (building a billion
    layers would otherwise hang long before any weight is read)."""
    found = {int(m.group(1)) for m in map(LAYER_TENSOR.match, tensor_names) if m}
    if len(found) != config.num_layers or (found and max(found) != config.num_layers - 1):
        held = f"layers 0..{max(found)} ({len(found)} of them)" if found else "no decoder layers"
        raise ModelLoadError(f"{where}: the config says num_hidden_layers={config.num_layers} but the weights hold "
                             f"{held}; fix the config or re-download the model")


def _source_parts(source: ModelSource):
    """(hf config dict, tensor iterator factory, tokenizer factory, tensor names factory) for a source."""
    if source.kind == "gguf":
        from qrun.gguf import open_gguf

        gguf = open_gguf(source.path)
        return (gguf.hf_config, gguf.tensors,
                lambda eos: Tokenizer(gguf.tokenizer(), gguf.tokenizer_config, eos), gguf.tensor_names)
    hf = read_hf_config(source.path)
    return (hf, lambda: iter_safetensors(source.path),
            lambda eos: Tokenizer.from_folder(source.path, eos), lambda: safetensors_names(source.path))


def read_model_config(model: str | Path) -> dict:
    """The Hugging Face config dict of `model` (a GGUF's, translated), without reading weights."""
    return _source_parts(resolve(model))[0]


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]],
                 dtype: torch.dtype, device: torch.device) -> None:
    """Assign checkpoint tensors (Hugging Face names) to the parameters of a meta-device model."""
    params = dict(model.named_parameters())
    expected = set(params)
    if getattr(model.config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        name = hf_name.removeprefix("model.")
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in params:
            if name == "lm_head.weight":  # a tied model may still ship its head
                continue
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} does not belong to this architecture")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ModelLoadError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(params[name].shape)}"
            )
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        # Packed tensors of quantized layers (and their float16 code ranges) keep their own dtype.
        keeps_dtype = attr in getattr(module, "stored_dtype_params", ())
        target = dtype if params[name].is_floating_point() and not keeps_dtype else params[name].dtype
        setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=target), requires_grad=False))
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}; is it complete?")
    model.tie_weights()


def load_model(model: str | Path, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", fuse_projections: bool = True) -> LoadedModel:
    """Resolve, load and return the model and tokenizer, ready for inference.

    `fuse_projections=False` keeps q/k/v and gate/up as the checkpoint's separate linears (for
    code that inspects or edits them one by one)."""
    source = resolve(model)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    hf_config, tensors, make_tokenizer, tensor_names = _source_parts(source)
    config = ModelConfig.from_hf(hf_config)
    check_layer_count(config, tensor_names(), str(source.path))
    with torch.device("meta"):
        net = Transformer(config, device=torch_device)
        if "quantization_config" in hf_config:
            from qrun.quant import swap_quantized_linears

            swap_quantized_linears(net, hf_config)
    load_weights(net, tensors(), torch_dtype, torch_device)
    if "quantization_config" in hf_config:
        from qrun.quant import prepare_quantized_linears, share_input_rotations

        share_input_rotations(net)
        prepare_quantized_linears(net)
    if fuse_projections:
        net.fuse_projections()
    if half_gemv_applies(torch_device, torch_dtype):
        use_half_gemv(net)
    net.eval().requires_grad_(False)
    return LoadedModel(net, config, make_tokenizer(list(config.eos_token_ids)), source, hf_config)
