"""Running one decoder layer over calibration rows, capturing what quantization needs.

Each calibration row is one sequence of L tokens; a chunk of rows runs as one flat prefill
batch over a throwaway one-layer KV cache (one block of L slots per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qrun.config import ModelConfig
from qrun.convert.gptq import HessianAccumulator
from qrun.format import LAYER_INPUTS, LAYER_LINEARS
from qrun.kernels import ops_for
from qrun.kv_cache import LayerKV
from qrun.model import AttentionMetadata, DecoderLayer

# The units the converter gives one candidate each, by the layer inputs (qrun/format.py) of their linears.
BLOCKS = {"attn": ("attn_in", "attn_out"), "mlp": ("mlp_in", "mlp_out")}


def block_linears(block: str) -> list[str]:
    """Names of a block's linears, in forward order."""
    return [name for layer_input in BLOCKS[block] for name in LAYER_INPUTS[layer_input]]


def empty_layer(config: ModelConfig) -> DecoderLayer:
    """A decoder layer of `config` on the meta device: the model's names and shapes, no weights."""
    with torch.device("meta"):
        return DecoderLayer(config, ops_for(torch.device("cpu")))


def build_layer(config, tensors: dict[str, torch.Tensor]) -> DecoderLayer:
    layer = empty_layer(config)  # no random initialisation of weights about to be replaced
    layer.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True, assign=True)
    return layer.eval().requires_grad_(False)


def linear_shapes(layer: DecoderLayer) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each of a layer's linears, by name."""
    return {name: tuple(layer.get_submodule(name).weight.shape) for name in LAYER_LINEARS}


@dataclass
class Rows:
    """Residual-stream state of every calibration row between two layers ([R, L, H] each)."""

    x: torch.Tensor
    residual: torch.Tensor | None


def save_rows(rows: Rows, path) -> None:
    from qrun.convert.job import atomic_torch_save

    atomic_torch_save({"x": rows.x, "residual": rows.residual}, path)


def load_rows(path) -> Rows:
    data = torch.load(path, weights_only=True)
    return Rows(data["x"], data["residual"])


class LayerRunner:
    def __init__(self, config, cos_sin: torch.Tensor, row_len: int, chunk_rows: int):
        self.config = config
        self.cos_sin = cos_sin
        self.row_len = row_len
        self.chunk_rows = chunk_rows

    def _meta(self, rows: int):
        length = self.row_len
        meta = AttentionMetadata.build([(0, length)] * rows, [[row] for row in range(rows)], length)  # a block per row
        shape = (rows, length, self.config.num_kv_heads, self.config.head_dim)
        positions = torch.arange(length).repeat(rows)
        return meta, positions, torch.zeros(shape), torch.zeros(shape)

    def heads(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """Attention heads on normed input h [r, L, H] -> o_proj's input [r, L, heads * head_dim]."""
        r = h.shape[0]
        meta, positions, kc, vc = self._meta(r)
        out = layer.self_attn.heads(h.reshape(r * self.row_len, -1), positions, self.cos_sin, meta, LayerKV(kc, vc))
        return out.view(r, self.row_len, -1)

    def attention(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """Attention sub-block on normed input h [r, L, H] -> [r, L, H]."""
        return layer.self_attn.o_proj(self.heads(layer, h))

    def run(self, layer: DecoderLayer, rows: Rows, sinks: dict | None = None, keep_inputs: int = 0):
        """Run the layer over all rows, handing every linear input to sinks[shared input name]
        (e.g. a HessianAccumulator's add) chunk by chunk. Returns (next Rows, sub-block inputs of
        the first `keep_inputs` rows: {"attn": [k, L, H], "mlp": [k, L, H]})."""
        sink = (lambda name, x: sinks[name](x)) if sinks else (lambda name, x: None)
        xs, residuals, kept_attn, kept_mlp = [], [], [], []
        for start in range(0, rows.x.shape[0], self.chunk_rows):
            x = rows.x[start:start + self.chunk_rows]
            res = None if rows.residual is None else rows.residual[start:start + self.chunk_rows]
            h, res = layer.input_layernorm(x, res)
            sink("attn_in", h)
            heads = self.heads(layer, h)
            sink("attn_out", heads)
            h2, res = layer.post_attention_layernorm(layer.self_attn.o_proj(heads), res)
            sink("mlp_in", h2)
            act = layer.mlp.hidden(h2)
            sink("mlp_out", act)
            if start < keep_inputs:
                kept_attn.append(h[: keep_inputs - start])
                kept_mlp.append(h2[: keep_inputs - start])
            xs.append(layer.mlp.down_proj(act))
            residuals.append(res)
        kept = {"attn": torch.cat(kept_attn), "mlp": torch.cat(kept_mlp)} if keep_inputs else {}
        return Rows(torch.cat(xs), torch.cat(residuals)), kept

    def chunked(self, fn, *tensors: torch.Tensor) -> torch.Tensor:
        """fn over row chunks of [R, L, ...] tensors, concatenated (bounds attention's memory)."""
        return torch.cat([fn(*(t[start:start + self.chunk_rows] for t in tensors))
                          for start in range(0, tensors[0].shape[0], self.chunk_rows)])

    def block_output(self, layer: DecoderLayer, block: str, h: torch.Tensor) -> torch.Tensor:
        return self.chunked(lambda c: self.attention(layer, c) if block == "attn" else layer.mlp(c), h)


def final_norm(config, other: dict[str, torch.Tensor]):
    """The model's final RMSNorm, built from the source's non-layer tensors."""
    from qrun.model import RMSNorm

    norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops_for(torch.device("cpu")))
    norm.weight.data = other["norm.weight"].float()
    return norm.requires_grad_(False)


def new_hessians(layer: DecoderLayer) -> dict[str, HessianAccumulator]:
    """An empty accumulator for each of the layer's inputs, by input name."""
    return {layer_input: HessianAccumulator(layer.get_submodule(linears[0]).in_features)
            for layer_input, linears in LAYER_INPUTS.items()}


def relative_error(y_hat: torch.Tensor, y: torch.Tensor) -> float:
    return float((y_hat - y).pow(2).sum() / y.pow(2).sum().clamp(min=1e-30))
