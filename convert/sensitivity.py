"""Sensitivity pass: what a perturbation of each block's output costs at the logits, in KL.

The optimizer needs, per block and candidate, a number that adds up across blocks to the
model's KL(reference || quantized). A block's output error is added to the residual stream; a
perturbation d_t of the stream at token t costs, to second order, 1/2 d_t^T F_t d_t nats, where
F_t is the Fisher information of the model's own next-token distributions with respect to that
stream position. With labels y sampled from the model itself, g = d/ds sum_positions log p(y)
satisfies E[g g^T] = F, so (g_t . d_t)^2 / 2 estimates the cost of d_t without bias.

Relative output error alone cannot rank blocks: SmolLM2's residual stream carries a few huge
channels that the norms divide away, and a block writing them (or one whose output later
layers amplify) is worth more or fewer bits than its error share says.

One forward pass over the score rows (full precision), then one backward pass, layer by layer
in reverse, each layer rebuilt from its split file: only one layer's weights in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qrun.convert.forward import LayerRunner, Rows, build_layer, final_norm
from qrun.convert.job import atomic_torch_save
from qrun.convert.split import load_layer_tensors


def layer_streams(runner: LayerRunner, layer, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual stream after the attention block and after the MLP block of one layer."""
    h, _ = layer.input_layernorm(stream, None)
    mid = stream + runner.attention(layer, h)
    h2, _ = layer.post_attention_layernorm(mid, None)
    return mid, mid + layer.mlp(h2)


def head_log_probs(config, other: dict):
    """stream [L, H] -> next-token log-probabilities [L, vocab] (final norm, then the head)."""
    norm = final_norm(config, other)
    head = other.get("lm_head.weight") if not config.tie_word_embeddings else None
    head = (other["embed_tokens.weight"] if head is None else head).float()
    return lambda stream: torch.log_softmax(norm(stream)[0] @ head.T, dim=-1)


def _head_gradient(config, stream: torch.Tensor, other: dict, seed: int) -> torch.Tensor:
    """d/d stream of sum log p(y) over every position, y sampled from the model's own softmax."""
    log_probs = head_log_probs(config, other)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for row in stream:  # one row at a time: its logits are [L, vocab]
        row = row.detach().requires_grad_()
        logp = log_probs(row)
        labels = torch.multinomial(logp.detach().exp(), 1, generator=gen)
        logp.gather(1, labels).sum().backward()
        grads.append(row.grad)
    return torch.stack(grads)


def block_gradients(config, runner: LayerRunner, rows: Rows, other: dict, src_dir: Path, out_dir: Path,
                    on_layer=None, seed: int = 0) -> None:
    """Write out_dir/grad_{i:04d}.pt = {"attn": g, "mlp": g} ([R, L, H] each) for every layer i:
    the Fisher-sampled gradient at the stream right after each block of layer i."""
    stream = rows.x if rows.residual is None else rows.x + rows.residual
    inputs = []
    with torch.no_grad():
        for i in range(config.num_layers):
            inputs.append(stream)
            stream = layer_streams(runner, build_layer(config, load_layer_tensors(src_dir, i)), stream)[1]
            if on_layer:
                on_layer()
    with torch.enable_grad():
        grad = _head_gradient(config, stream, other, seed)
    for i in reversed(range(config.num_layers)):
        layer = build_layer(config, load_layer_tensors(src_dir, i))
        with torch.enable_grad():
            stream = inputs[i].clone().requires_grad_()
            mid, out = layer_streams(runner, layer, stream)
            mid.retain_grad()
            out.backward(grad)
        atomic_torch_save({"attn": mid.grad.detach(), "mlp": grad}, out_dir / f"grad_{i:04d}.pt")
        grad = stream.grad.detach()
        if on_layer:
            on_layer()


def load_block_gradients(out_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / f"grad_{layer:04d}.pt", weights_only=True)


def predicted_kl(delta: torch.Tensor, grad: torch.Tensor) -> float:
    """Second-order KL (nats per token) of adding delta [R, L, H] to the stream with gradient grad."""
    return float(0.5 * (delta * grad).sum(-1).pow(2).mean())
