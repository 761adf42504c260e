"""Building a ready-to-run model and tokenizer from any model source.

Weights stream in one tensor at a time onto a model built on the meta device, so loading
never holds two full copies of the weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from qrun.config import ModelConfig
from qrun.cpu_linear import cpu_dense_linears_apply, use_cpu_dense_linears
from qrun.errors import ModelLoadError, one_line
from qrun.heap import trim_heap
from qrun.huge_pages import move_to_huge_pages
from qrun.model import Transformer
from qrun.sources import ModelSource, read_json_object, resolve
from qrun.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight dtypes by the names safetensors headers give them; anything else is refused.
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# Checkpoint entries that carry no weights of ours (precomputed RoPE tables in old exports).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource
    hf_config: dict
    # What an `auto` KV cache stores: the model's dtype, or float16 where the load holds a float32 model's linears in
    # float16 (a CPU without native bfloat16: `resolve_dtype`), at half float32's bytes. On a Xeon held to AVX2,
    # SmolLM2's first 32 mixed_lengths requests ran 176-181 tok/s against 133-139 in float32, at 4.0 bpw 177-183
    # against 133-137 (one-off probes, LLM.generate, greedy).
    kv_dtype: torch.dtype

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
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX, per /proc/cpuinfo) and torch's CPU kernels
    use it (they run AVX-512 code: not where ATEN_CPU_CAPABILITY holds them to AVX2)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
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
    the CPU has native bfloat16 arithmetic, else float32 with the dense linears' weights held in
    float16 (`load_model`, `cpu_linear.CpuDenseLinear`; where torch runs AVX2 kernels or better).

    A CPU decode step reads every weight once, so half the bytes is up to twice the speed: at
    batch 1 SmolLM2 in bfloat16 ran 1.7x float32 on an AVX512-BF16 CPU. Without native support
    bfloat16 matmuls are emulated and lose to float32, while float16 weights convert to float32 in
    one instruction per 8 (F16C): a float16 GEMV at a few rows, the float32 weights (the same
    values) at more.
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
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; is this a Hugging Face model folder?")
    return read_json_object(path)


def _weight_map(folder: Path) -> dict[str, str]:
    """model.safetensors.index.json's tensor name -> shard file name; empty without an index."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return {}
    weight_map = read_json_object(index).get("weight_map")
    # A shard is a file of this folder: a name with a path in it could point anywhere on the disk.
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) and shard and Path(shard).name == shard
                                                   for shard in weight_map.values()):
        raise ModelLoadError(f"{index}: weight_map must map tensor names to shard files of this folder; "
                             "re-download the model")
    return weight_map


def safetensors_files(folder: Path) -> list[Path]:
    shards = sorted(set(_weight_map(folder).values()))
    if shards:
        files = [folder / shard for shard in shards]
        index = folder / "model.safetensors.index.json"
        try:
            missing = [f.name for f in files if not f.is_file()]
        except OSError as err:  # a name no file can have (too long)
            raise ModelLoadError(f"{index} names a shard that cannot exist ({err.strerror}); "
                                 "re-download the model") from None
        if missing:
            raise ModelLoadError(f"{index} names weight shards {', '.join(map(repr, missing))} that {folder} lacks; "
                                 "re-download the model")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (other weight formats are not supported)")
    return files


def _read_shards(folder: Path, read: Callable[[Path, Any], Iterable]) -> Iterator:
    """What `read(file, shard)` yields for each open weight file of `folder`; a damaged file (found
    on opening or while reading) is a ModelLoadError naming it."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as shard:
                yield from read(file, shard)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ModelLoadError(f"{file} is truncated or corrupt ({one_line(err)}); re-download it") from None


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    return _read_shards(folder, lambda _, shard: ((name, shard.get_tensor(name)) for name in shard.keys()))


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor as its file's header describes it; nothing of it is read."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name for it: F32, BF16, I32, ... (a GGUF's weights load as F32)
    file: Path


@dataclass(frozen=True)
class TensorIndex:
    """Every tensor a model's weight files hold, from their headers alone."""

    tensors: dict[str, StoredTensor]
    files: list[Path]
    planned: dict[str, str]  # where a shard index places each tensor: name -> file name

    def home(self, name: str) -> Path:
        """The file that should hold tensor `name`: its shard per the index, else the only weight
        file, else their folder."""
        shard = self.planned.get(name) or self.planned.get(f"model.{name}")
        if shard:
            return self.files[0].parent / shard
        return self.files[0] if len(self.files) == 1 else self.files[0].parent


def safetensors_index(folder: Path) -> TensorIndex:
    def describe(file: Path, shard) -> Iterator[tuple[str, StoredTensor]]:
        for name in shard.keys():
            stored = shard.get_slice(name)
            yield name, StoredTensor(tuple(stored.get_shape()), stored.get_dtype(), file)

    tensors: dict[str, StoredTensor] = {}
    for name, stored in _read_shards(folder, describe):
        if name in tensors:
            raise ModelLoadError(f"{stored.file}: tensor {name!r} is also in {tensors[name].file.name}; "
                                 "re-download the model")
        tensors[name] = stored
    return TensorIndex(tensors, safetensors_files(folder), _weight_map(folder))


# A decoder layer's tensor, as checkpoints name it: (layer index, the name within the layer).
LAYER_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def check_layer_count(config: ModelConfig, tensor_names: list[str], where: str, described_by: str) -> None:
    """Fail fast when the config's layer count disagrees with the weights (building a billion
    layers would otherwise hang long before any weight is read)."""
    found = {int(m.group(1)) for m in map(LAYER_TENSOR.match, tensor_names) if m}
    if len(found) != config.num_layers or (found and max(found) != config.num_layers - 1):
        held = f"layers 0..{max(found)} ({len(found)} of them)" if found else "no decoder layers"
        raise ModelLoadError(f"{where}: {described_by} says num_hidden_layers={config.num_layers} but the weights "
                             f"hold {held}; fix the config or re-download the model")


class SourceParts(NamedTuple):
    """What loading needs from a model source; only the config is read up front."""

    hf_config: dict
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Callable[[list[int]], Tokenizer]  # from the eos token ids
    tensor_index: Callable[[], TensorIndex]


def _source_parts(source: ModelSource) -> SourceParts:
    if source.kind == "gguf":
        from qrun.gguf import open_gguf

        gguf = open_gguf(source.path)
        return SourceParts(
            gguf.hf_config, gguf.tensors, lambda eos: Tokenizer(gguf.tokenizer(), gguf.tokenizer_config, eos),
            lambda: TensorIndex({name: StoredTensor(shape, "F32", source.path)
                                 for name, shape in gguf.tensor_shapes().items()}, [source.path], {}))
    hf = read_hf_config(source.path)
    return SourceParts(hf, lambda: iter_safetensors(source.path), lambda eos: Tokenizer.from_folder(source.path, eos),
                       lambda: safetensors_index(source.path))


def _described_by(source: ModelSource) -> tuple[Path, str]:
    """The file a source's config comes from, and how a message names it."""
    if source.kind == "gguf":
        return source.path, "its metadata"
    return source.path / "config.json", "config.json"


def read_model_config(model: str | Path) -> dict:
    """The Hugging Face config dict of `model` (a GGUF's, translated), without reading weights."""
    return _source_parts(resolve(model)).hf_config


def _parameter_name(hf_name: str, params: dict[str, nn.Parameter]) -> str | None:
    """The model parameter a checkpoint tensor loads into; None for tensors that carry nothing of ours."""
    name = hf_name.removeprefix("model.")
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and name not in params):
        return None  # RoPE tables of old exports; the head a tied model may still ship
    return name


def _takes_model_dtype(model: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether parameter `name` loads in the model's dtype (a float weight stored in any float
    dtype) or keeps its own (packed tensors of quantized layers, and their float16 code ranges)."""
    module_name, _, attr = name.rpartition(".")
    keeps_dtype = getattr(model.get_submodule(module_name), "stored_dtype_params", ())
    return param.is_floating_point() and attr not in keeps_dtype


def check_tensors(model: nn.Module, index: TensorIndex, described_by: str) -> None:
    """Every stored tensor belongs to `model` (built on the meta device) with the shape and a dtype
    its parameter takes, and none is missing. Checked from the headers alone, before any weight is
    read, so nothing is ever allocated from a size the model does not expect. `described_by` names
    what the model was built from (config.json, a GGUF's metadata)."""
    params = dict(model.named_parameters())
    for hf_name, stored in index.tensors.items():
        name = _parameter_name(hf_name, params)
        if name is None:
            continue
        if name not in params:
            raise ModelLoadError(f"{stored.file}: tensor {hf_name!r} belongs to no layer of the model "
                                 f"{described_by} describes; is this the model's own config?")
        param = params[name]
        if stored.shape != tuple(param.shape):
            raise ModelLoadError(f"{stored.file}: tensor {hf_name!r} has shape {stored.shape}, "
                                 f"{described_by} implies {tuple(param.shape)}")
        stored_as = STORED_DTYPES.get(stored.dtype)
        if _takes_model_dtype(model, name, param):
            fits, needed = stored_as in FLOAT_DTYPES, "a float dtype"
        else:
            fits, needed = stored_as == param.dtype, str(param.dtype).removeprefix("torch.")
        if not fits:
            raise ModelLoadError(f"{stored.file}: tensor {hf_name!r} is stored as {stored.dtype}; it must be {needed}")
    expected = set(params) - ({"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set())
    present = {_parameter_name(name, params) for name in index.tensors}
    missing = sorted(expected - present)
    if missing:
        raise ModelLoadError(f"{index.home(missing[0])}: lacks {len(missing)} tensors {described_by} calls for, "
                             f"e.g. {missing[0]!r}; is the download complete?")


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 device: torch.device, index: TensorIndex) -> None:
    """Assign checkpoint tensors (Hugging Face names), checked against `model` by `check_tensors`,
    to the parameters of a meta-device model.

    A weight holding NaN or infinity is refused, naming it: such a model only ever answers with
    NaN logits, which a user would otherwise meet as gibberish far from the cause (llama.cpp and
    vLLM load it silently). So is one that overflows `dtype` (a float32 weight past float16's range).
    """
    params = dict(model.named_parameters())
    for hf_name, tensor in tensors:
        name = _parameter_name(hf_name, params)
        if name is None:
            continue
        param = params[name]
        value = tensor.to(device=device, dtype=dtype if _takes_model_dtype(model, name, param) else param.dtype)
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ModelLoadError(_non_finite(index.tensors[hf_name].file, hf_name, tensor, value))
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
    model.tie_weights()


def _non_finite(file: Path, name: str, stored: torch.Tensor, loaded: torch.Tensor) -> str:
    """Why tensor `name`, as loaded, holds a NaN or infinity: overflowing the model's dtype, or stored so."""
    if loaded.dtype != stored.dtype and bool(torch.isfinite(stored).all()):
        return (f"{file}: tensor {name!r} overflows {str(loaded.dtype).removeprefix('torch.')} (values beyond "
                f"{torch.finfo(loaded.dtype).max:.0f}); load the model in bfloat16 or float32")
    return f"{file}: tensor {name!r} holds NaN or infinite values; the file is damaged: re-download or re-convert it"


def load_model(model: str | Path, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", fuse_projections: bool = True) -> LoadedModel:
    """Resolve, load and return the model and tokenizer, ready for inference.

    `fuse_projections=False` keeps q/k/v and gate/up as the checkpoint's separate linears (for
    code that inspects or edits them one by one)."""
    source = resolve(model)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    hf_config, tensors, make_tokenizer, tensor_index = _source_parts(source)
    config_file, described_by = _described_by(source)
    config = ModelConfig.from_hf(hf_config, str(config_file))
    index = tensor_index()
    check_layer_count(config, list(index.tensors), str(source.path), described_by)
    with torch.device("meta"):
        net = Transformer(config, device=torch_device)
        if "quantization_config" in hf_config:
            from qrun.quant import swap_quantized_linears

            try:
                swap_quantized_linears(net, hf_config)
            except ModelLoadError as err:
                raise ModelLoadError(f"{config_file}: {err}") from None
    check_tensors(net, index, described_by)
    tokenizer = make_tokenizer(list(config.eos_token_ids))
    if tokenizer.vocab_size > config.vocab_size:  # its ids would index past the embeddings
        tokenizer_file = source.path if source.kind == "gguf" else source.path / "tokenizer.json"
        raise ModelLoadError(f"{tokenizer_file}: token ids run to {tokenizer.vocab_size - 1}, past the "
                             f"{config.vocab_size} embeddings {described_by} gives the model; "
                             "is it this model's tokenizer?")
    load_weights(net, tensors(), torch_dtype, torch_device, index)
    quantized = "quantization_config" in hf_config
    if quantized:
        from qrun.quant import prepare_quantized_linears, share_input_rotations

        share_input_rotations(net)
    if fuse_projections:
        net.fuse_projections()
    if quantized:
        prepare_quantized_linears(net)  # those left unfused: a fused matmul is built whole
    dense_on_cpu = cpu_dense_linears_apply(torch_device, torch_dtype, half_weights=dtype == "auto")
    if dense_on_cpu:
        use_cpu_dense_linears(net)
    net.eval().requires_grad_(False)
    if torch_device.type == "cpu":
        trim_heap()  # the load's freed memory, before the copy into huge pages maps its arena
        move_to_huge_pages(net)
    trim_heap()
    kv_dtype = torch.float16 if dense_on_cpu and torch_dtype == torch.float32 else torch_dtype
    return LoadedModel(net, config, tokenizer, source, hf_config, kv_dtype)
