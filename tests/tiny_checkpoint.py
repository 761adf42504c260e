"""Tiny random Hugging Face checkpoints, made on the spot by transformers, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VOCAB = 300


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE (256 byte tokens, no merges) plus the special tokens the models use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
    }))


def make_tiny_checkpoint(folder: Path, family: str, seed: int = 0, head_dim: int = 16,
                         vocab_size: int = TINY_VOCAB) -> Path:
    """Save a random 2-layer model of `family` (llama, qwen2, mistral) with transformers, 4 query
    heads of `head_dim` (64: a head size the C++ CPU attention has); embeddings past the
    tokenizer's TINY_VOCAB tokens are never looked up."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=258, bos_token_id=None)
    if family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random biases, so a dropped bias shows in the logits
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=4096, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(config)
    else:
        raise ValueError(family)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder
