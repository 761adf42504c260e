"""Loading llama.cpp GGUF files as if they were Hugging Face checkpoints.

A GGUF holds the config, the tokenizer and the (often quantized) weights in one file, under
llama.cpp's names and layouts. `open_gguf` reads the metadata only and translates it into a
`config.json`-like dict and a `tokenizer_config.json`-like dict; `GGUFModel.tensors()` then
dequantizes the memory-mapped weights one tensor at a time under Hugging Face names and shapes,
so the rest of qrun loads a GGUF exactly like a safetensors folder.

    model = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    config = ModelConfig.from_hf(model.hf_config)
    for name, tensor in model.tensors(): ...
"""

from __future__ import annotations

import math
import re
import struct
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from qrun.errors import ModelLoadError, one_line

# general.architecture -> Hugging Face class. llama.cpp writes Mistral models as "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp tensor names (after "blk.N.") -> Hugging Face names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# llama.cpp token types (llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp uses them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# Llama 3 style vocabularies look whole words up before merging (HF's `ignore_merges`).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"}


def _reader_class():
    import gguf

    class CheckedReader(gguf.GGUFReader):
        """GGUFReader over a plain-ndarray view of its memory map, whose every read stays inside the file.

        The reader slices the map once per metadata part (several per vocabulary string, ~250k for
        a 49k vocabulary), and numpy's memmap subclass costs microseconds per slice in
        `__array_finalize__`; a plain view of the same mapping makes opening ~3.5x faster.

        Past the end of the file gguf's reader gets short (empty) slices and walks on, so a count
        from a damaged header (a trillion array items) ran for as long as it claimed; here such a
        read is an error. An array of numbers is read as one slice, where gguf's reader takes a
        Python step per item: a file's time to open is bounded by its metadata, not by its size.
        """

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
            end = offset + np.dtype(dtype).itemsize * int(count)
            if end > len(self._plain):
                raise ValueError(f"{int(count)} x {np.dtype(dtype).name} at byte {offset} run past the end of the "
                                 f"file ({len(self._plain)} bytes)")
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if raw_type == gguf.GGUFValueType.ARRAY:
                item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
                number = self.gguf_scalar_to_np.get(int(item_type[0]))
                if number is not None:
                    items = self._get(orig_offs + 12, number, count[0])
                    # parts and types as gguf's reader gives them, all items in one part
                    return (12 + items.nbytes, [item_type, count, items], [2],
                            [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(int(item_type[0]))])
                if item_type[0] == gguf.GGUFValueType.STRING and self.byte_order == "I" and sys.byteorder == "little":
                    return self._strings(orig_offs, item_type, count)
            return super()._get_field_parts(orig_offs, raw_type)

        def _strings(self, orig_offs: int, item_type: np.ndarray, count: np.ndarray) -> tuple:
            """An array of strings, each item's (length, bytes) parts as memoryview slices (which
            have the `nbytes` and `tobytes` that gguf's fields use) walked in one loop: gguf's
            reader makes numpy slices, ~1 s for a 49k-token vocabulary and its merges."""
            view, end = memoryview(self._plain), len(self._plain)
            parts: list = [item_type, count]
            offset = orig_offs + 12
            for _ in range(int(count[0])):
                if offset + 8 > end:
                    raise ValueError(f"string {(len(parts) - 2) // 2} of {int(count[0])} at byte {offset} runs past "
                                     f"the end of the file ({end} bytes)")
                (length,) = struct.unpack_from("<Q", view, offset)
                if offset + 8 + length > end:
                    raise ValueError(f"a string of {length} bytes at byte {offset} runs past the end of the file "
                                     f"({end} bytes)")
                parts += (view[offset:offset + 8], view[offset + 8:offset + 8 + length])
                offset += 8 + length
            return (offset - orig_offs, parts, list(range(3, len(parts), 2)),
                    [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING])

    return CheckedReader


def _corrupt(path: Path, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path} is truncated or corrupt ({problem}); re-download it")


@dataclass
class GGUFModel:
    """A GGUF file's config and tokenizer, translated to Hugging Face form; weights stay on disk."""

    path: Path
    hf_config: dict
    tokenizer_config: dict
    _reader: Any = field(default=None, repr=False)
    _metadata: dict = field(default_factory=dict, repr=False)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, float32 tensor in HF shape), one tensor at a time.

        Only one dequantized tensor is alive per step, so loading never holds the weights twice.
        llama.cpp stores Llama's q_proj/k_proj rows permuted (it rotates interleaved pairs, HF
        rotates halves); that permutation is undone here. A tied model yields no lm_head.weight:
        `tie_word_embeddings` in hf_config says to reuse the embedding.
        """
        arch = self._metadata["general.architecture"]
        heads = self.hf_config["num_attention_heads"]
        kv_heads = self.hf_config["num_key_value_heads"]
        for tensor in self._reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:  # llama3 rope factors: folded into hf_config["rope_scaling"]
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists dims fastest-first
            values = self._dequantize(tensor, shape)
            if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                values = _unpermute(values, heads)
            elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                values = _unpermute(values, kv_heads)
            yield name, torch.from_numpy(values)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> HF shape of each tensor `tensors` yields, read from the index alone."""
        return {_hf_name(t.name): tuple(int(d) for d in reversed(t.shape.tolist()))
                for t in self._reader.tensors if _hf_name(t.name) is not None}

    def _dequantize(self, tensor, shape: tuple[int, ...]) -> np.ndarray:
        """float32 values of one tensor, dequantized a few MiB of rows at a time into the result,
        so a big quantized matrix never has full-size float32 temporaries next to it."""
        from gguf.quants import dequantize

        out = np.empty(shape, dtype=np.float32)
        rows_out = out.reshape(-1, shape[-1])
        rows_in = tensor.data.reshape(rows_out.shape[0], -1)
        step = max(1, (4 << 20) // (4 * rows_out.shape[1]))
        blocks = _BLOCK_VALUES.get(tensor.tensor_type.name)
        try:
            for start in range(0, rows_out.shape[0], step):
                if blocks is not None:
                    chunk = blocks(torch.from_numpy(np.array(rows_in[start:start + step]))).numpy()
                else:  # a damaged block's NaN is for the loader to report, naming the tensor, not numpy
                    with np.errstate(invalid="ignore"):
                        chunk = dequantize(rows_in[start:start + step], tensor.tensor_type)
                rows_out[start:start + step] = chunk.reshape(-1, shape[-1])
        except (NotImplementedError, ValueError) as err:
            raise ModelLoadError(
                f"{self.path}: cannot read tensor {tensor.name} of type {tensor.tensor_type.name} ({err})"
            ) from None
        return out

    def tokenizer(self):
        """A `tokenizers.Tokenizer` rebuilt from the vocabulary, merges and token types in the file."""
        try:
            return _build_tokenizer(self._metadata, self.tokenizer_config)
        except ModelLoadError as err:
            raise ModelLoadError(f"{self.path}: {err}") from None
        except Exception as err:  # the tokenizers library's own errors are plain Exceptions
            raise ModelLoadError(f"{self.path}: its vocabulary makes no tokenizer ({one_line(err)})") from None


def _blocks(data: torch.Tensor, block_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows of whole blocks -> (the blocks [B, block_bytes], each one's float16 scale d as float32 [B, 1])."""
    blocks = data.reshape(-1, block_bytes)
    return blocks, _halves(blocks[:, :2])


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """[B, 2] bytes, a float16 each row -> float32 [B, 1]."""
    return pairs.contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> float32 [B, 32] codes: the low nibbles first, then the high ones (ggml's order)."""
    codes = torch.empty(packed.shape[0], 32)
    codes[:, :16] = packed & 15
    codes[:, 16:] = packed >> 4
    return codes


def _q4_0(data: torch.Tensor) -> torch.Tensor:
    blocks, d = _blocks(data, 18)
    return _nibbles(blocks[:, 2:]).sub_(8).mul_(d)


def _q4_1(data: torch.Tensor) -> torch.Tensor:
    blocks, d = _blocks(data, 20)
    return _nibbles(blocks[:, 4:]).mul_(d).add_(_halves(blocks[:, 2:4]))


def _q8_0(data: torch.Tensor) -> torch.Tensor:
    blocks, d = _blocks(data, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)


def _shifted(packed: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """uint8 [B, n, 1, w] -> [B, n, len(shifts), w]: each byte shifted right by each of `shifts`, masked."""
    return (packed >> torch.tensor(shifts, dtype=torch.uint8).view(1, 1, -1, 1)) & mask


def _k_scales(blocks: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's sub-block scales and offsets, float32 [B, 8, 1]: d and dmin (bytes 0-3) times 6-bit
    codes packed in bytes 4-15 (bytes 0-3 of them: scales 0-3 and the top bits of 4-7; 4-7: offsets 0-3 and
    the top bits of 4-7; 8-11: the low bits of scales and offsets 4-7)."""
    low, high, mixed = blocks[:, 4:16].reshape(-1, 3, 4).unbind(1)
    scales = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    offsets = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=1)
    return (d * scales.float()).unsqueeze(-1), (_halves(blocks[:, 2:4]) * offsets.float()).unsqueeze(-1)


def _q4_k(data: torch.Tensor) -> torch.Tensor:
    blocks, d = _blocks(data, 144)
    scales, offsets = _k_scales(blocks, d)
    codes = _shifted(blocks[:, 16:].reshape(-1, 4, 1, 32), (0, 4), 15).reshape(-1, 8, 32).float()
    return codes.mul_(scales).sub_(offsets).reshape(-1, 256)


def _q5_k(data: torch.Tensor) -> torch.Tensor:
    blocks, d = _blocks(data, 176)
    scales, offsets = _k_scales(blocks, d)
    low = _shifted(blocks[:, 48:].reshape(-1, 4, 1, 32), (0, 4), 15).reshape(-1, 8, 32)
    high = _shifted(blocks[:, 16:48].reshape(-1, 1, 1, 32), tuple(range(8)), 1).reshape(-1, 8, 32)
    return (low | (high << 4)).float().mul_(scales).sub_(offsets).reshape(-1, 256)


def _q6_k(data: torch.Tensor) -> torch.Tensor:
    blocks = data.reshape(-1, 210)  # low digits, high digits, 16 int8 scales, then d
    scales = (_halves(blocks[:, 208:]) * blocks[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    low = _shifted(blocks[:, :128].reshape(-1, 2, 1, 64), (0, 4), 15).reshape(-1, 8, 32)
    high = _shifted(blocks[:, 128:192].reshape(-1, 2, 1, 32), (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    codes = ((low | (high << 4)).view(torch.int8) - 32).reshape(-1, 16, 16).float()
    return codes.mul_(scales).reshape(-1, 256)


# llama.cpp's block types -> their values, float32 [blocks, values a block], from uint8 rows of whole blocks: the
# same float32 arithmetic as gguf.quants (equal bit for bit, tested) at ~2-2.5x its speed (one-off probe, 4 M values
# a type, best of 3, a 2-core Xeon: Q4_1 0.68 G values/s against 0.29 G, Q8_0 1.24 against 0.56, Q4_K 0.66 against
# 0.27, Q6_K 0.53 against 0.28). Other types (Q2_K, Q3_K, Q5_0/1, ...) go through gguf.quants.
_BLOCK_VALUES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def open_gguf(path: str | Path) -> GGUFModel:
    """Read a GGUF's metadata and tensor index (weights stay memory-mapped, unread)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise _corrupt(path, "no GGUF magic at the start")
    try:
        reader = _reader_class()(path, "r")
        meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except Exception as err:  # the reader raises ValueError/IndexError/KeyError/UnicodeError on bad bytes
        raise _corrupt(path, f"{type(err).__name__}: {one_line(err)}") from None
    _check_tensor_layout(path, reader)
    arch = meta.get("general.architecture")
    if arch is None:
        raise _corrupt(path, "missing metadata key 'general.architecture'")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; qrun supports {', '.join(sorted(ARCHITECTURES))}"
        )
    names = {t.name for t in reader.tensors}
    for name in names:
        if _hf_name(name) is None and name != "rope_freqs.weight":
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {arch} model")
    hf_config = _hf_config(path, meta, reader, names)
    _check_vocabulary(path, meta)
    return GGUFModel(path, hf_config, _tokenizer_config(meta), reader, meta)


def _check_tensor_layout(path: Path, reader) -> None:
    """The tensor index by llama.cpp's rules (ggml's gguf.cpp): 1 to 4 dimensions of at least 1,
    rows of whole quantization blocks, and the data of each tensor where the previous one's ends,
    padded to the alignment, in index order, the last inside the file. Overlapping tensors, gaps
    (a tensor retyped to a smaller type) and offsets past the end all break the last rule."""
    from gguf import GGML_QUANT_SIZES

    expected = 0
    for tensor in reader.tensors:
        dims = [int(d) for d in tensor.shape]  # fastest-varying first
        if not 1 <= len(dims) <= 4 or min(dims) < 1:
            raise _corrupt(path, f"tensor {tensor.name} has dimensions {dims}")
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        if dims[0] % block:
            raise _corrupt(path, f"tensor {tensor.name}'s rows of {dims[0]} are not whole {tensor.tensor_type.name} "
                                 f"blocks of {block}")
        size = math.prod(dims) // block * block_bytes
        offset = tensor.data_offset - reader.data_offset
        if offset != expected:
            raise _corrupt(path, f"tensor {tensor.name}'s data starts at {offset}, not where the tensor before it "
                                 f"ends ({expected})")
        expected += -(-size // reader.alignment) * reader.alignment
        if tensor.data_offset + size > len(reader.data):
            raise _corrupt(path, f"tensor {tensor.name} extends past the end of the file")


def _check_vocabulary(path: Path, meta: dict) -> None:
    """The tokenizer metadata `_tokenizer_config` and `_build_tokenizer` read has the types and
    lengths they need."""
    tokens = _require(path, meta, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise _corrupt(path, "tokenizer.ggml.tokens is not a list of strings")
    for key, kind in (("token_type", int), ("scores", float)):
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is not None and not (isinstance(values, list) and len(values) == len(tokens)
                                       and all(_is_kind(v, kind) for v in values)):
            raise _corrupt(path, f"tokenizer.ggml.{key} does not hold one number per token")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise _corrupt(path, "tokenizer.ggml.merges is not a list of strings")
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not (_is_kind(value, int) and 0 <= value < len(tokens)):
            raise _corrupt(path, f"tokenizer.ggml.{key} {value!r:.40} is not one of its {len(tokens)} token ids")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise _corrupt(path, f"metadata key {key!r} is not a string")


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _is_kind(value: Any, kind: type) -> bool:
    """Whether metadata `value` is a `kind` (int, float or str): an int counts as a float, a bool as neither."""
    return not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind)


def _require(path: Path, meta: dict, key: str) -> Any:
    if key not in meta:
        raise _corrupt(path, f"missing metadata key {key!r}")
    return meta[key]


def _hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor; None for rope_freqs (not a parameter) and unknowns."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's `permute`: per head, rows (pair, half) -> (half, pair)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _hf_config(path: Path, meta: dict, reader, names: set[str]) -> dict:
    arch = meta["general.architecture"]

    def key(suffix: str, default: Any = None, required: bool = False, kind: type = int) -> Any:
        full = f"{arch}.{suffix}"
        value = _require(path, meta, full) if required else meta.get(full, default)
        if value is not None and not _is_kind(value, kind):
            raise _corrupt(path, f"metadata key {full!r} holds {value!r:.40}, not {_KIND_NAMES[kind]}")
        return value

    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise _corrupt(path, "no token_embd.weight tensor")
    hf_arch = ARCHITECTURES[arch]
    if arch == "llama" and _says_mistral(meta):
        hf_arch = "MistralForCausalLM"
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": hf_arch.removesuffix("ForCausalLM").lower(),
        "vocab_size": int(key("vocab_size") or embed.shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5, kind=float)),
        "rope_theta": float(key("rope.freq_base", 10000.0, kind=float)),
        "rope_scaling": None,
        "max_position_embeddings": int(key("context_length", required=True)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch == "llama" else None)
    if head_dim:
        config["head_dim"] = int(head_dim)
    if arch == "qwen2":
        config["use_sliding_window"] = False
    config["rope_scaling"] = _rope_scaling(path, arch, key, reader, config)
    return config


def _says_mistral(meta: dict) -> bool:
    """llama.cpp stores Mistral as "llama"; only the model's own name tells them apart."""
    name = str(meta.get("general.basename") or meta.get("general.name") or "")
    return name.lower().startswith("mistral")


def _rope_scaling(path: Path, arch: str, key: Callable[..., Any], reader, config: dict) -> dict | None:
    """HF rope_scaling from `<arch>.rope.scaling.*`, or Llama 3's from its rope_freqs tensor.

    llama.cpp bakes Llama 3 scaling into per-frequency divisors (rope_freqs.weight) and keeps no
    parameters, so we recover them: the largest divisor is `factor`; the remaining ones are the
    values every Llama 3.x release uses, checked against the stored divisors.
    """
    rope_type = key("rope.scaling.type", kind=str)
    factor = key("rope.scaling.factor", kind=float)
    original = key("rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        from qrun.config import ModelConfig

        if freqs.tensor_type.name != "F32":
            raise _corrupt(path, f"rope_freqs.weight is {freqs.tensor_type.name}, not F32")
        divisors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
        scaling = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": int(original or 8192)}
        hf = dict(config, rope_scaling=None)
        plain = np.array(ModelConfig.from_hf(hf, str(path)).rope_inv_freq())
        scaled = np.array(ModelConfig.from_hf(dict(hf, rope_scaling=scaling), str(path)).rope_inv_freq())
        if plain.shape != divisors.shape or not np.allclose(plain / scaled, divisors, rtol=1e-3):
            raise ModelLoadError(f"{path}: rope_freqs.weight matches no Llama 3 rope scaling qrun knows")
        return scaling
    if rope_type in (None, "none") or not factor or float(factor) == 1.0:
        return None
    scaling = {"rope_type": rope_type, "factor": float(factor)}
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _tokenizer_config(meta: dict) -> dict:
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says not to.
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"
    return {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }


def _build_tokenizer(meta: dict, tok_config: dict):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = {i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)}
    added |= {meta[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                                    "padding_token_id") if f"tokenizer.ggml.{k}" in meta}
    if kind == "gpt2":
        alphabet = set(_bytes_to_unicode().values())
        # Vocabulary entries are spelled in GPT-2's byte alphabet; an added token may be stored as
        # raw text, which the added-token matcher needs as is, so only ordinary tokens are respelled.
        vocab = {(t if i in added or set(t) <= alphabet else _byte_spell(t)): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        pre = meta.get("tokenizer.ggml.pre")
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        if pre in _PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            if pre not in (None, "default", "gpt2", "smollm"):
                warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting text the GPT-2 way", stacklevel=3)
            steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
            if pre == "smollm":  # llama.cpp splits every digit off first, as SmolLM's tokenizer.json does
                steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
            tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        if pre in ("qwen2", "deepseek-r1-qwen"):
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        vocab = {t: i for i, t in enumerate(tokens)}
        if "tokenizer.ggml.merges" in meta:
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        else:
            merges = _merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk = tok_config.get("unk_token")
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r}; qrun supports gpt2 and llama")

    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(added) if types[i] != _USER_DEFINED])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in sorted(added) if types[i] == _USER_DEFINED])
    # HF's tokenizer.json adds BOS/EOS in its post-processor; do the same when the file asks for it.
    ends = [(key, meta.get(f"tokenizer.ggml.{key}_token_id")) for key in ("bos", "eos")
            if tok_config[f"add_{key}_token"] and meta.get(f"tokenizer.ggml.{key}_token_id") is not None]
    if ends:
        ids = dict(ends)
        bos = [tokens[ids["bos"]]] if "bos" in ids else []
        eos = [tokens[ids["eos"]]] if "eos" in ids else []
        tok.post_processor = processors.TemplateProcessing(
            single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
            special_tokens=[(tokens[i], i) for i in ids.values()])
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges a sentencepiece vocabulary implies: every split of a token into two tokens,
    best-scoring result first (the order sentencepiece applies them), as HF's converter does."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_spell(text: str) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))
