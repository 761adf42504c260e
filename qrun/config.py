"""Model configuration: one dataclass for every supported decoder family.

Llama, Qwen2 and Mistral differ only in a few switches (q/k/v bias, tied head,
RoPE scaling, sliding window), so they share one definition in `model.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qrun.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

# What `kv_cache_dtype` may name (qrun/kv_cache.py gives each its meaning; listed here, in a
# module without torch, so command-line help can offer them without importing it).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")

# What a config may claim, checked before anything is built from it; no released model comes
# near. Dimensions up to 2^24 keep every tensor's byte count within int64 (a model is first built
# on the meta device, sized from the config). The rotary table, max_position_embeddings x head_dim
# float32, is the one thing built for real from the config alone: at most 2 GiB, which is
# Llama-3-8B-Gradient-4194k's 4M positions at head_dim 128.
MAX_DIMENSION = 1 << 24
MAX_HEAD_DIM = 1024
MAX_ROTARY_TABLE = 1 << 29  # entries


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"qrun supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 or self.head_dim > MAX_HEAD_DIM:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even (rotary embeddings pair its "
                                 f"dimensions) and at most {MAX_HEAD_DIM}")
        if self.max_model_len * self.head_dim > MAX_ROTARY_TABLE:
            raise ModelLoadError(
                f"a context of {self.max_model_len} positions at head_dim {self.head_dim} needs a rotary table of "
                f"{self.max_model_len * self.head_dim * 4 / 2**30:.1f} GiB, over qrun's {MAX_ROTARY_TABLE * 4 >> 30} "
                "GiB; lower max_position_embeddings")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)

    @property
    def max_model_len(self) -> int:
        """Longest context the model runs exactly.

        Attention here is always full causal; a sliding-window model is exact only while the
        context fits inside its window, so the window caps the context.
        """
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; errors start with `where` (the file it came from)."""
        try:
            return cls._from_hf(hf)
        except ModelLoadError as err:
            raise ModelLoadError(f"{where}: {err}") from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        if not isinstance(hf, dict):
            raise ModelLoadError(f"holds {_brief(hf)}, not a JSON object")
        archs = hf.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelLoadError(f"field 'architectures' must be a list of class names, got {_brief(archs)}")
        if not archs:
            raise ModelLoadError(f"no 'architectures' entry; qrun supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        hidden = _size(hf, "hidden_size")
        heads = _size(hf, "num_attention_heads")
        sliding = _size(hf, "sliding_window", None) if hf.get("sliding_window") else None  # 0 or false: no window
        if arch == "Qwen2ForCausalLM" and not _flag(hf, "use_sliding_window", False):
            sliding = None
        # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"field 'rope_scaling' must be an object, got {_brief(rope)}")
        theta = _positive(hf, "rope_theta", None) or _positive(rope, "rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
        if not all(_is_integer(i) and i >= 0 for i in eos_ids):
            raise ModelLoadError(f"field 'eos_token_id' must be a token id or a list of them, got {_brief(eos)}")
        bos = hf.get("bos_token_id")
        if bos is not None and not (_is_integer(bos) and bos >= 0):
            raise ModelLoadError(f"field 'bos_token_id' must be a token id, got {_brief(bos)}")
        return cls(
            architecture=arch,
            vocab_size=_size(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_size(hf, "intermediate_size"),
            num_layers=_size(hf, "num_hidden_layers", most=math.inf),  # sizes no tensor; the weights bound it
            num_heads=heads,
            num_kv_heads=_size(hf, "num_key_value_heads", heads),
            head_dim=_size(hf, "head_dim", hidden // heads),
            rms_norm_eps=_positive(hf, "rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=_size(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=_flag(hf, "tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama may declare them.
            attention_bias=arch == "Qwen2ForCausalLM" or _flag(hf, "attention_bias", False),
            mlp_bias=_flag(hf, "mlp_bias", False),
            sliding_window=sliding,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=[int(i) for i in eos_ids],
        )

    def rope_inv_freq(self) -> "list[float]":
        """Inverse frequencies of the rotary embedding, with Llama 3 / linear scaling applied."""
        dim = self.head_dim
        inv = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            return [f / float(scaling["factor"]) for f in inv]
        if kind != "llama3":
            return inv
        factor = float(scaling["factor"])
        low, high = _positive(scaling, "low_freq_factor", 1.0), _positive(scaling, "high_freq_factor", 4.0)
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        scaled = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                scaled.append(f)
            elif wavelen > low_wavelen:
                scaled.append(f / factor)
            else:
                smooth = (original / wavelen - low) / (high - low)
                scaled.append((1 - smooth) * f / factor + smooth * f)
        return scaled


_REQUIRED = object()


def _brief(value: Any) -> str:
    """A field's value for a one-line message: repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_integer(value: Any) -> bool:
    return not isinstance(value, bool) and (isinstance(value, int) or isinstance(value, float) and value.is_integer())


def _field(fields: dict, key: str, default: Any) -> Any:
    value = fields.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"required field {key!r} is missing")
        return default
    return value


def _size(fields: dict, key: str, default: Any = _REQUIRED, most: float = MAX_DIMENSION) -> Any:
    """A dimension or count: an integer from 1 to `most` (`default` when absent or null; None stays None)."""
    value = _field(fields, key, default)
    if value is None:
        return value
    if not _is_integer(value) or not 1 <= value <= most:
        raise ModelLoadError(f"field {key!r} must be an integer from 1 to {most}, got {_brief(value)}")
    return int(value)


def _positive(fields: dict, key: str, default: Any = _REQUIRED) -> Any:
    """A positive finite number (`default` when absent or null; None stays None)."""
    value = _field(fields, key, default)
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelLoadError(f"field {key!r} must be a positive finite number, got {_brief(value)}")
    return float(value)


def _flag(fields: dict, key: str, default: bool) -> bool:
    value = _field(fields, key, default)
    if not isinstance(value, bool):
        raise ModelLoadError(f"field {key!r} must be true or false, got {_brief(value)}")
    return value


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """The rope_scaling fields `rope_inv_freq` divides by are there, positive and finite."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3", "linear"):
        raise ModelLoadError(f"unsupported rope_scaling type {_brief(kind)}; qrun supports default, linear and llama3")
    if kind == "default":
        return
    _positive(scaling, "factor")
    if kind == "llama3":
        _size(scaling, "original_max_position_embeddings")
        low, high = _positive(scaling, "low_freq_factor", 1.0), _positive(scaling, "high_freq_factor", 4.0)
        if high <= low:
            raise ModelLoadError(f"rope_scaling's high_freq_factor ({high}) must exceed its low_freq_factor ({low})")
