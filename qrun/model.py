"""One decoder-only transformer for Llama, Qwen2 and Mistral, run over a flat batch.

A step's tokens from many sequences arrive back to back in one [T] vector, with no padding;
`AttentionMetadata` says where each sequence's tokens lie and where its K/V live in the paged
cache. Parameter names follow Hugging Face checkpoints (minus the leading `model.`), so weights
load by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from qrun.config import ModelConfig
from qrun.kernels import ops_for, rotary_cos_sin
from qrun.kv_cache import KVCache, LayerKV


@dataclass
class StepLayout:
    """Where a flat batch's sequences lie, as lists: what `AttentionMetadata` holds as tensors. The
    C++ model (qrun/cpu_model.py) takes the lists themselves."""

    slot_mapping: list[int]  # [T] cache slot of each new token's K/V
    block_tables: list[int]  # [S * table_width], each sequence's table padded with block 0 to table_width
    table_width: int
    seq_lens: list[int]  # [S] context length including the new tokens
    query_start_loc: list[int]  # [S + 1]

    @classmethod
    def of(cls, spans: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
           compiled: bool = False) -> "StepLayout":
        """The layout of a step where sequence s computes positions spans[s] = (start, end) and
        keeps its K/V in the blocks block_tables[s]. `compiled`: for the compiled decode layer,
        whose graphs expect tables two blocks wide or more (a graph would otherwise specialise on
        width 1 and compile once more)."""
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        for (start, end), table in zip(spans, block_tables):
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            seq_lens.append(end)
            query_start.append(query_start[-1] + end - start)
        width = max(2 if compiled else 1, *(len(table) for table in block_tables))
        tables: list[int] = []
        for table in block_tables:
            tables += table
            tables += [0] * (width - len(table))
        return cls(slots, tables, width, seq_lens, query_start)


@dataclass
class AttentionMetadata:
    """Where a flat batch's sequences lie, in the layout `kernels.paged_attention` documents."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token's K/V
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, context length including the new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, spans: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu", compiled: bool = False) -> "AttentionMetadata":
        """Metadata for a step where sequence s computes positions spans[s] = (start, end) and
        keeps its K/V in the blocks block_tables[s] (`StepLayout.of`'s arguments)."""
        return cls.of(StepLayout.of(spans, block_tables, block_size, compiled), device)

    @classmethod
    def of(cls, layout: StepLayout, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """`layout` as tensors on `device`."""
        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        starts = layout.query_start_loc
        return cls(tensor(layout.slot_mapping, torch.int64), tensor(layout.block_tables).view(-1, layout.table_width),
                   tensor(layout.seq_lens), tensor(starts), max(end - start for start, end in zip(starts, starts[1:])),
                   max(layout.seq_lens))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # q/k/v quantized in one rotated basis: the loader puts that rotation here, so x is rotated
        # once instead of once per projection (qrun/quant.py: share_input_rotations)
        self.qkv_input = nn.Identity()
        self.qkv_proj: nn.Module | None = None  # q/k/v as one matmul (fuse_projections)
        self.qkv_sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.scale = self.head_dim ** -0.5
        self.ops = ops
        # called with each forward's queries and keys after rotary (qrun/kv_cache.py's calibration)
        self.observe_queries_keys: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata, cache: LayerKV) -> torch.Tensor:
        return self.o_proj(self.heads(x, positions, cos_sin, meta, cache))

    def heads(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              meta: AttentionMetadata, cache: LayerKV) -> torch.Tensor:
        """The attention heads' output, concatenated: o_proj's input."""
        x = self.qkv_input(x)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = self.ops.apply_rotary(q, k, positions, cos_sin)
        if self.observe_queries_keys is not None:
            self.observe_queries_keys(q, k)
        if cache.k_mean is not None:  # a quantized cache holds calibrated keys (qrun/kv_cache.py)
            q, k = q * cache.q_balance, (k - cache.k_mean) * cache.k_balance
        if cache.k_reflection is not None:
            q, k = self.ops.reflect(q, cache.k_reflection), self.ops.reflect(k, cache.k_reflection)
        signs, factors = cache.rotation_signs, cache.rotation_factors
        if signs is not None:  # ... rotated (qrun/kv_cache.py)
            q, k, v = (self.ops.rotate(t, signs, factors) for t in (q, k, v))
        self.ops.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scales, cache.v_scales)
        out = self.ops.paged_attention(
            q, cache.k, cache.v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, meta.max_seq_len, self.scale, None, cache.k_scales, cache.v_scales,
        )
        if signs is not None:
            out = self.ops.unrotate(out, signs, factors)
        return out.flatten(1)

    def fuse_projections(self) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv_proj is not None:
            self.q_proj = self.k_proj = self.v_proj = None


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        self.ops = ops
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up_input = nn.Identity()  # as Attention.qkv_input, for gate/up
        self.gate_up_proj: nn.Module | None = None  # gate/up as one matmul (fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The gated activation: down_proj's input."""
        x = self.gate_up_input(x)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.ops.silu_and_mul(gate, up)

    def fuse_projections(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        if self.gate_up_proj is not None:
            self.gate_proj = self.up_proj = None


def fuse_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One linear computing all of `linears` on the same input, outputs concatenated in order
    (fewer, larger matmuls per step); None when they cannot be fused."""
    if all(type(lin) is nn.Linear for lin in linears):
        with_bias = [lin.bias is not None for lin in linears]
        if any(with_bias) and not all(with_bias):
            return None
        first = linears[0].weight
        fused = nn.Linear(first.shape[1], sum(lin.out_features for lin in linears), bias=all(with_bias),
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
        if all(with_bias):
            fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
        return fused
    fuse = getattr(type(linears[0]), "fuse", None)
    return fuse(linears) if fuse is not None else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, x, residual, positions, cos_sin, meta, cache: LayerKV):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_sin, meta, cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        ops = ops_for(torch.device(device))
        # the loader assigns every weight: no random init (on the meta device the embedding's normal_ imports
        # torch._dynamo, ~1.3 s of a load)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Positions beyond max_model_len are rejected before they reach the model. The device is
        # explicit so the table is real even when the weights are built on the meta device.
        self.register_buffer("cos_sin", rotary_cos_sin(config.rope_inv_freq(), config.max_model_len, device),
                             persistent=False)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up each as one matmul: what the engine runs (checkpoints and the
        converter name them apart)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, layers: Callable | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, one row per input token.
        `layers(x, residual, positions, meta, kv_cache)` runs the decoder layers in place of
        `run_layers` (the C++ model: `qrun/cpu_model.py`)."""
        x = self.embed_tokens(input_ids)
        residual = torch.zeros_like(x)  # the first layer adds one too, so one compiled graph serves all
        x, residual = (layers or self.run_layers)(x, residual, positions, meta, kv_cache)
        x, _ = self.norm(x, residual)
        return x

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_cache: KVCache,
                   layer_forward: Callable = DecoderLayer.__call__) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after every decoder layer, each run by `layer_forward(layer, x, residual, ...)`
        (the compiled layer: `qrun/compiled_decode.py`)."""
        for layer, cache in zip(self.layers, kv_cache.layers):
            x, residual = layer_forward(layer, x, residual, positions, self.cos_sin, meta, cache)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the given hidden rows (only the rows that sample a token)."""
        return self.lm_head(hidden).float()
