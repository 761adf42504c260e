"""The paged KV cache: what `kv_cache_dtype` names, what a token costs in it, and its tensors.

A float cache stores K and V as computed. A quantized one (int8, int4) stores them per token,
per KV head, with a float16 scale per group of head_dim (`kernels/kv_quant.py` has the layout),
after a Hadamard rotation along head_dim: keys have a few outlier channels that would set every
group's scale, and the rotation spreads them over all channels. The query is rotated the same
way, so q . k is unchanged, and the attention output is rotated back (V is stored rotated too).

Before rotating, each layer's keys are calibrated (`key_calibration`, measured once on a short
built-in text when the model is loaded):
- the layer's mean key (per KV head and channel) is subtracted: a channel bias that every key
  shares would otherwise widen every key's range. It is exact: a query's scores all shift by
  q . mean_k, which softmax ignores. (Centring values the same way, adding their mean back to the
  output, measured worse in a one-window SmolLM2 experiment, 0.035 against 0.030 KL at int4, so
  values are stored as they come.)
- each channel of the keys is multiplied by a balance b and the queries' by 1 / b, so q . k is
  unchanged. After the rotation every channel's quantization error is about the same, and what
  it costs a score grows with the query: the error of q . k scales with
  sum_c (rms k_c b_c)^2 * sum_c (rms q_c / b_c)^2, which b_c = sqrt(rms q_c / rms k_c) minimises
  (Cauchy-Schwarz; SmoothQuant's balance for a product of two quantized operands). Rounded to a
  power of two, so both multiplications are exact in every float dtype. In a throwaway
  experiment on SmolLM2 (int4, issue 18's 8 windows, keys quantized alone) it took the keys' KL
  from 0.0173 to 0.0153; balancing by the keys alone (b = 1 / rms k) made it worse (0.0196). Without the
  rotation the balance is not applied (errors then follow each group's range: it cost there).
- the keys and queries of each KV head are reflected (x - 2 (x . u) u, `rotation.reflect`) so that the
  calibration text's first key, centred and balanced, points along the first axis, which the
  rotation turns into a vector with every element equal. A sequence's first token is an attention
  sink: most heads put much of their weight on it, so its key's quantization error moves every
  score, and its key is far from the mean (a large shared component, whatever the token). After
  the reflection that component becomes a constant per group, which the asymmetric int4/int8 groups
  absorb into their zero: the first key quantizes about as well as the rest.
  `scripts/kv_cache_quality.py` (int4, rotated): KL 0.0187 -> 0.0121 on SmolLM2, 0.0228 -> 0.0156 on
  its 4.0-bpw conversion; keeping the first key unquantized instead gave 0.0164 on the latter in a
  throwaway fake-quant experiment. Applied with the rotation only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qrun.config import KV_CACHE_DTYPES, ModelConfig
from qrun.errors import QrunError
from qrun.kernels.kv_quant import QUANTIZED_KV_MIN_CAPABILITY, SCALE_DTYPE, kv_group_size, storage_dtype
from qrun.kernels.rotation import random_signs, rotation_factors

if TYPE_CHECKING:
    from qrun.model import Transformer
    from qrun.tokenizer import Tokenizer

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BITS = {"int8": 8, "int4": 4}
_ROTATION_SEED = 0x6b76  # any fixed seed: the signs only need to be the same for q, k and v


@dataclass(frozen=True)
class KVCacheSpec:
    """How the cache stores K and V: floats in `dtype`, or `bits`-bit integers (`dtype` is
    then what they are dequantized to and the rotation's dtype)."""

    dtype: torch.dtype
    bits: int | None = None
    rotate: bool = True  # quantized caches only

    @classmethod
    def parse(cls, name: str, model_dtype: torch.dtype, auto_dtype: torch.dtype | None = None) -> "KVCacheSpec":
        """The spec `kv_cache_dtype=name` means for a model computing in `model_dtype`; `auto` stores
        floats in `auto_dtype` (`LoadedModel.kv_dtype`), by default the model's."""
        if name == "auto":
            return cls(auto_dtype or model_dtype)
        if name in _FLOAT_DTYPES:
            return cls(_FLOAT_DTYPES[name])
        if name in _BITS:
            return cls(model_dtype, _BITS[name])
        raise ValueError(f"kv_cache_dtype={name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def name(self) -> str:
        return f"int{self.bits}" if self.quantized else str(self.dtype).removeprefix("torch.")

    def head_shapes(self, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """What one token of one KV head stores: its values' shape, and its scales' shape (None
        for a float cache)."""
        if not self.quantized:
            return (head_dim,), None
        return (head_dim * self.bits // 8,), (head_dim // kv_group_size(head_dim, self.bits), 2)

    def bytes_per_token(self, config: ModelConfig) -> int:
        """Bytes of K and V one token keeps, over all layers, scales included."""
        values, scales = self.head_shapes(config.head_dim)
        element = storage_dtype(self.bits).itemsize if self.quantized else self.dtype.itemsize
        per_head = math.prod(values) * element + (math.prod(scales) * SCALE_DTYPE.itemsize if scales else 0)
        return 2 * config.num_layers * config.num_kv_heads * per_head


@dataclass
class LayerKV:
    """One layer's view of the cache, as the attention kernels take it."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    # q, k and v go in rotated (the kernel table's `rotate` with these signs and factors), the
    # attention's output comes back through `unrotate`; None: not rotated
    rotation_signs: torch.Tensor | None = None  # [D] +-1 float32
    rotation_factors: tuple[torch.Tensor, ...] | None = None  # rotation_factors(D), held for compiled graphs
    # A quantized cache's key calibration (`key_calibration`), in the cache's dtype: keys go in as
    # (k - k_mean) * k_balance, queries as q * q_balance (1 / k_balance of each query's KV head)
    k_mean: torch.Tensor | None = None  # [Hkv, D]
    k_balance: torch.Tensor | None = None  # [Hkv, D], powers of two
    q_balance: torch.Tensor | None = None  # [H, D]
    # then both reflected by `reflect` with these unit vectors (float32 [Hkv, D]) before the rotation
    k_reflection: torch.Tensor | None = None


@dataclass(frozen=True)
class KeyCalibration:
    """One layer's key transform for a quantized cache (module docstring), float32 [Hkv, D]."""

    mean: torch.Tensor
    balance: torch.Tensor
    reflection: torch.Tensor  # unit vectors u (zero: no reflection needed)

    @classmethod
    def measure(cls, queries: torch.Tensor, keys: torch.Tensor) -> "KeyCalibration":
        """From a text's queries [n, H, D] and keys [n, Hkv, D] after rotary, the text's first
        token first."""
        keys, queries = keys.float(), queries.float()
        mean = keys.mean(0)
        key_rms = (keys - mean).pow(2).mean(0).sqrt()
        query_rms = queries.unflatten(1, (keys.shape[1], -1)).pow(2).mean((0, 2)).sqrt()
        tiny = torch.finfo(torch.float32).tiny  # a channel that never moves: balanced as far as the clamp allows
        balance = (query_rms.clamp_min(tiny) / key_rms.clamp_min(tiny)).clamp(1e-4, 1e4).sqrt()
        exponent = balance.log2() - balance.log2().mean(-1, keepdim=True)  # centred: magnitudes stay put
        balance = torch.exp2(exponent.round())
        return cls(mean, balance, _reflection_onto_first_axis((keys[0] - mean) * balance))


def _reflection_onto_first_axis(vectors: torch.Tensor) -> torch.Tensor:
    """Per row of vectors [..., D], the unit u whose reflection x - 2 (x . u) u takes the row's
    direction to the first axis; zero where it already points there."""
    tiny = torch.finfo(vectors.dtype).tiny
    difference = vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(tiny)
    difference[..., 0] -= 1
    norm = difference.norm(dim=-1, keepdim=True)
    return torch.where(norm > 1e-6, difference / norm.clamp_min(tiny), torch.zeros_like(difference))


class KVCache:
    """One preallocated pool of fixed-size blocks per layer, for keys and for values."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, spec: KVCacheSpec,
                 device: torch.device | str, key_calibrations: list[KeyCalibration] | None = None):
        """`key_calibrations`: each layer's from `key_calibration()`, which a quantized cache
        applies to keys and queries (None: keys and queries as they come)."""
        head_dim = config.head_dim
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads)
        _check_device(spec, torch.device(device))
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k_scales = self.v_scales = self.rotation_signs = self.rotation_factors = None
        values, scales = spec.head_shapes(head_dim)
        storage = storage_dtype(spec.bits) if spec.quantized else spec.dtype
        self.k = torch.zeros(*shape, *values, dtype=storage, device=device)
        self.v = torch.zeros_like(self.k)
        if spec.quantized:
            self.k_scales = torch.zeros(*shape, *scales, dtype=SCALE_DTYPE, device=device)
            self.v_scales = torch.zeros_like(self.k_scales)
            if spec.rotate:
                self.rotation_signs = random_signs(head_dim, _ROTATION_SEED).to(device)
                self.rotation_factors = rotation_factors(head_dim, torch.device(device))
        self.layers = [LayerKV(self.k[i], self.v[i], *(None if s is None else s[i] for s in (self.k_scales, self.v_scales)),
                               self.rotation_signs, self.rotation_factors) for i in range(config.num_layers)]
        if spec.quantized and key_calibrations is not None:
            group = config.num_heads // config.num_kv_heads
            for layer, calibration in zip(self.layers, key_calibrations):
                # the balance assumes the rotation's even spread of errors: unrotated, it cost (0.029 -> 0.036)
                balance = calibration.balance if spec.rotate else torch.ones_like(calibration.balance)
                layer.k_mean = calibration.mean.to(device=device, dtype=spec.dtype)
                layer.k_balance = balance.to(device=device, dtype=spec.dtype)
                layer.q_balance = balance.reciprocal().repeat_interleave(group, 0).to(device=device, dtype=spec.dtype)
                if spec.rotate:
                    layer.k_reflection = calibration.reflection.to(device=device, dtype=torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed [layer, block, ...]: what copying a block copies."""
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None]


def _check_device(spec: KVCacheSpec, device: torch.device) -> None:
    if spec.quantized and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < QUANTIZED_KV_MIN_CAPABILITY:
            raise QrunError(f"kv_cache_dtype={spec.name} needs an Ampere or newer GPU (sm_80+); this one is "
                            f"sm_{major}{minor}: use a float cache (--kv-cache-dtype auto)")


# Prose of the Brown corpus's calibration genres (press, hobbies, lore, letters, government,
# learned), a little code and dialogue; read up to CALIBRATION_TOKENS of it.
CALIBRATION_TEXT = Path(__file__).with_name("data") / "kv_calibration.txt"
CALIBRATION_TOKENS = 1024


@torch.inference_mode()
def key_calibration(model: "Transformer", tokenizer: "Tokenizer") -> list[KeyCalibration]:
    """Each layer's `KeyCalibration` over the calibration text: one forward pass, at load."""
    from qrun.model import AttentionMetadata

    ids = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    ids = ids[:min(CALIBRATION_TOKENS, model.config.max_model_len)]
    n, device = len(ids), model.cos_sin.device
    scratch = KVCache(model.config, 1, n, KVCacheSpec(model.embed_tokens.weight.dtype), device)
    calibrations: list[KeyCalibration | None] = [None] * len(model.layers)

    def observer(index: int):
        def observe(queries: torch.Tensor, keys: torch.Tensor) -> None:
            calibrations[index] = KeyCalibration.measure(queries, keys)
        return observe

    for index, layer in enumerate(model.layers):
        layer.self_attn.observe_queries_keys = observer(index)
    try:
        model(torch.tensor(ids, device=device), torch.arange(n, device=device),
              AttentionMetadata.build([(0, n)], [[0]], n, device), scratch)
    finally:
        for layer in model.layers:
            layer.self_attn.observe_queries_keys = None
    return calibrations
