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
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ModelLoadError(
                    f"unsupported rope_scaling type {kind!r}; qrun supports default, linear and llama3"
                )

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
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ModelLoadError(
                "config.json has no 'architectures' entry; "
                f"qrun supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            eos = hf.get("eos_token_id")
            sliding = hf.get("sliding_window")
            if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
                sliding = None
            # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
            rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
            theta = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta),
                rope_scaling=rope,
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama may declare them.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks required field {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise ModelLoadError(f"config.json has a malformed field: {bad}") from None

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
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
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
