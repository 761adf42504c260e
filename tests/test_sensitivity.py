"""The sensitivity pass: its gradients turn a block's output error into the KL that error costs."""

import torch

from qrun.config import ModelConfig
from qrun.convert.forward import LayerRunner, Rows, build_layer
from qrun.convert.split import load_layer_tensors, load_other_tensors, split_source
from qrun.convert.sensitivity import (block_gradients, head_log_probs, layer_streams, load_block_gradients,
                                      predicted_kl)
from qrun.kernels.rotary import rotary_cos_sin
from qrun.loader import _source_parts
from qrun.sources import resolve


def _kl_of_perturbation(config, runner, src, other, stream, layer_index, block, delta) -> float:
    """Actual mean KL(reference || perturbed) per token when delta is added after one block."""
    log_probs = head_log_probs(config, other)
    clean, perturbed = stream, stream
    for i in range(config.num_layers):
        layer = build_layer(config, load_layer_tensors(src, i))
        clean = layer_streams(runner, layer, clean)[1]
        if i == layer_index and block == "attn":
            mid = layer_streams(runner, layer, perturbed)[0] + delta
            h2, _ = layer.post_attention_layernorm(mid, None)
            perturbed = mid + layer.mlp(h2)
        else:
            perturbed = layer_streams(runner, layer, perturbed)[1]
            if i == layer_index:
                perturbed = perturbed + delta
    ref = torch.stack([log_probs(r) for r in clean])
    got = torch.stack([log_probs(r) for r in perturbed])
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def _stream_after(config, runner, src, stream, layer_index, block):
    for i in range(layer_index + 1):
        mid, stream = layer_streams(runner, build_layer(config, load_layer_tensors(src, i)), stream)
    return mid if block == "attn" else stream


def test_predicted_kl_matches_the_kl_a_small_block_error_causes(tiny_llama_dir, tmp_path):
    source = resolve(str(tiny_llama_dir))
    hf_config, tensors, _, _ = _source_parts(source)
    config = ModelConfig.from_hf(hf_config)
    split_source(tensors(), config, tmp_path)
    other = load_other_tensors(tmp_path)
    rows, length = 16, 32
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (rows, length), generator=gen)
    runner = LayerRunner(config, rotary_cos_sin(config.rope_inv_freq(), config.max_model_len, torch.device("cpu")),
                         length, chunk_rows=rows)
    stream = other["embed_tokens.weight"][tokens]
    with torch.no_grad():
        block_gradients(config, runner, Rows(stream, None), other, tmp_path, tmp_path)
        for layer_index, block in ((0, "attn"), (config.num_layers - 1, "mlp")):
            # a small error (5% of the stream it lands in): the regime where second order holds
            scale = 0.05 * _stream_after(config, runner, tmp_path, stream, layer_index, block).std()
            delta = torch.randn(rows, length, config.hidden_size, generator=gen) * scale
            actual = _kl_of_perturbation(config, runner, tmp_path, other, stream, layer_index, block, delta)
            predicted = predicted_kl(delta, load_block_gradients(tmp_path, layer_index)[block])
            assert actual > 0
            assert 0.6 < predicted / actual < 1.6, (layer_index, block, predicted, actual)
