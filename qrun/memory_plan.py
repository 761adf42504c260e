"""What fits on a card: weights, reserve, KV cache capacity and a decode-speed bound, from a
model's config alone (no weights are read).

`kv_blocks` is also how the engine sizes its cache, so a plan's KV tokens are exactly what
`LLM(model, kv_cache_memory=plan.kv_budget)` allocates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from qrun.config import ModelConfig
from qrun.kv_cache import KVCacheSpec

GIB = 2**30

# A quantized head's 8-bit group scales and per-column ranges, on top of its code bits (a
# 6-bit SmolLM2 head measured 6.11 bpw).
PLANNED_HEAD_EXTRA_BITS = 0.11

# The CUDA context, cuBLAS/Triton workspaces and allocator slack: memory a process holds
# before and beside its tensors (a CUDA context alone takes 300-500 MiB on recent drivers).
CUDA_RESERVE = 768 * 2**20


@dataclass(frozen=True)
class Card:
    name: str
    model: str  # as CUDA device names spell it ("NVIDIA GeForce RTX 4090")
    memory: int  # bytes
    bandwidth: float  # bytes / s, the vendor's peak memory bandwidth


CARDS = {card.name: card for card in [
    Card("t4", "T4", 16 * GIB, 320e9),
    Card("rtx3060", "RTX 3060", 12 * GIB, 360e9),
    Card("rtx3080", "RTX 3080", 10 * GIB, 760e9),
    Card("rtx3090", "RTX 3090", 24 * GIB, 936e9),
    Card("rtx4060ti", "RTX 4060 Ti", 16 * GIB, 288e9),
    Card("rtx4070", "RTX 4070", 12 * GIB, 504e9),
    Card("rtx4080", "RTX 4080", 16 * GIB, 717e9),
    Card("rtx4090", "RTX 4090", 24 * GIB, 1008e9),
    Card("rtx5090", "RTX 5090", 32 * GIB, 1792e9),
    Card("a10", "A10", 24 * GIB, 600e9),
    Card("l4", "L4", 24 * GIB, 300e9),
    Card("a100-40gb", "A100", 40 * GIB, 1555e9),
    Card("a100-80gb", "A100", 80 * GIB, 2039e9),
    Card("h100", "H100", 80 * GIB, 3350e9),
    Card("h200", "H200", 141 * GIB, 4800e9),
]}


def card_named(device_name: str, memory: int) -> Card | None:
    """The known card a CUDA device ("NVIDIA A100-SXM4-80GB", with `memory` bytes) is, if any:
    of the cards whose model its name spells out as whole words, the one closest in memory."""
    matches = [card for card in CARDS.values()
               if re.search(rf"\b{re.escape(card.model)}\b(?! Ti)", device_name, re.IGNORECASE)]
    return min(matches, key=lambda card: abs(card.memory - memory), default=None)


def kv_blocks(budget: int, config: ModelConfig, cache: KVCacheSpec, block_size: int,
              max_num_seqs: int, max_model_len: int) -> int:
    """KV blocks a budget of `budget` bytes buys, capped at what every sequence slot could use
    at full context (more could never be used). May be 0: the caller decides whether that is
    an error."""
    per_block = cache.bytes_per_token(config) * block_size
    useful = max_num_seqs * -(-max_model_len // block_size)
    return max(0, min(budget // per_block, useful))


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of a model's weights, by part."""

    linears: int  # the decoder layers' projections
    embedding: int
    head: int  # 0 when tied to the embedding (it reads the embedding instead)
    other: int  # norms and biases

    @property
    def total(self) -> int:
        return self.linears + self.embedding + self.head + self.other

    @property
    def read_per_step(self) -> int:
        """What one decode step at batch 1 reads: all but the embedding, of which it reads one
        row, unless the head is the embedding."""
        return self.linears + self.other + (self.head or self.embedding)


def weight_bytes(config: ModelConfig, dtype: torch.dtype, linear_bpw: float | None = None,
                 head_bpw: float | None = None) -> WeightBytes:
    """Weight bytes of `config` with dense tensors in `dtype`; the layer projections at
    `linear_bpw` bits per weight and the head at `head_bpw` when quantized (None: dense). A
    quantized head is stored untied, as `qrun convert` writes it."""
    element = torch.empty(0, dtype=dtype).element_size()
    h, hd = config.hidden_size, config.head_dim
    qkv_out = (config.num_heads + 2 * config.num_kv_heads) * hd
    per_layer = h * qkv_out + config.num_heads * hd * h + 3 * h * config.intermediate_size
    linears = config.num_layers * per_layer
    linear_bytes = int(linears * linear_bpw / 8) if linear_bpw else linears * element
    head_params = config.vocab_size * h
    if head_bpw:
        head = int(head_params * head_bpw / 8)
    else:
        head = 0 if config.tie_word_embeddings else head_params * element
    biases = config.num_layers * ((qkv_out if config.attention_bias else 0)
                                  + (3 * config.intermediate_size if config.mlp_bias else 0))
    norms = (2 * config.num_layers + 1) * h
    return WeightBytes(linear_bytes, head_params * element, head, (biases + norms) * element)


def activation_bytes(config: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak activations of one step: a full token budget's hidden states, q/k/v, attention
    output and MLP intermediates in `dtype`, plus float32 logits (and a sampling copy) for every
    sequence."""
    element = torch.empty(0, dtype=dtype).element_size()
    hd = config.head_dim
    per_token = (3 * config.hidden_size + (2 * config.num_heads + 2 * config.num_kv_heads) * hd
                 + 3 * config.intermediate_size)
    return max_num_batched_tokens * per_token * element + 2 * max_num_seqs * config.vocab_size * 4


@dataclass(frozen=True)
class MemoryPlan:
    config: ModelConfig
    memory: int  # the card's memory in bytes
    weights: WeightBytes
    reserve: int  # CUDA context and workspaces, plus peak activations
    cache: KVCacheSpec
    block_size: int
    kv_budget: int  # bytes left for the KV cache
    kv_tokens: int  # what that budget holds, as the engine allocates it
    max_num_seqs: int
    max_model_len: int

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.block_size

    def concurrent_sequences(self, length: int) -> int:
        """Sequences of `length` tokens (prompt + output) the cache holds at once."""
        blocks = self.kv_tokens // self.block_size
        return min(blocks // -(-length // self.block_size), self.max_num_seqs)

    def decode_tokens_per_second(self, bandwidth: float, context: int) -> float:
        """Single-stream decode speed at `context` tokens if every step read its bytes (weights
        plus that context's K/V) at `bandwidth`: the roofline, an upper bound."""
        step = self.weights.read_per_step + context * self.cache.bytes_per_token(self.config)
        return bandwidth / step


def plan(config: ModelConfig, memory: int, *, dtype: torch.dtype = torch.float16, linear_bpw: float | None = None,
         head_bpw: float | None = None, block_size: int = 16, max_num_seqs: int = 64,
         max_num_batched_tokens: int = 512, max_model_len: int | None = None,
         kv_cache_dtype: str = "auto") -> MemoryPlan:
    """How `memory` bytes of a CUDA card divide between weights, reserve and KV cache."""
    cache = KVCacheSpec.parse(kv_cache_dtype, dtype)
    weights = weight_bytes(config, dtype, linear_bpw, head_bpw)
    reserve = CUDA_RESERVE + activation_bytes(config, dtype, max_num_batched_tokens, max_num_seqs)
    budget = max(0, memory - weights.total - reserve)
    length = min(max_model_len or config.max_model_len, config.max_model_len)
    blocks = kv_blocks(budget, config, cache, block_size, max_num_seqs, length)
    return MemoryPlan(config, memory, weights, reserve, cache, block_size, budget, blocks * block_size,
                      max_num_seqs, length)
