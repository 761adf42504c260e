"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, for tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TINY = dict(vocab=32, hidden=32, ffn=64, layers=2, heads=4, kv_heads=2)  # Q8_0 needs rows of 32k


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(seed: int = 0, bias: bool = False) -> dict[str, np.ndarray]:
    """Random float32 weights of a TINY Llama (q/k/v biases when `bias`), under Hugging Face names."""
    rng = np.random.default_rng(seed)
    h, f, v, hd = TINY["hidden"], TINY["ffn"], TINY["vocab"], TINY["hidden"] // TINY["heads"]
    kv = TINY["kv_heads"] * hd
    out = {"model.embed_tokens.weight": rng.standard_normal((v, h)), "model.norm.weight": rng.standard_normal(h),
           "lm_head.weight": rng.standard_normal((v, h))}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": rng.standard_normal(h),
            p + "post_attention_layernorm.weight": rng.standard_normal(h),
            p + "self_attn.q_proj.weight": rng.standard_normal((h, h)),
            p + "self_attn.k_proj.weight": rng.standard_normal((kv, h)),
            p + "self_attn.v_proj.weight": rng.standard_normal((kv, h)),
            p + "self_attn.o_proj.weight": rng.standard_normal((h, h)),
            p + "mlp.gate_proj.weight": rng.standard_normal((f, h)),
            p + "mlp.up_proj.weight": rng.standard_normal((f, h)),
            p + "mlp.down_proj.weight": rng.standard_normal((h, f)),
        })
        if bias:
            out.update({p + "self_attn.q_proj.bias": rng.standard_normal(h),
                        p + "self_attn.k_proj.bias": rng.standard_normal(kv),
                        p + "self_attn.v_proj.bias": rng.standard_normal(kv)})
    return {k: v.astype(np.float32) for k, v in out.items()}


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a Hugging Face tensor name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], quant: bool = False,
               tokenizer: dict | None = None, extra: dict[str, np.ndarray] | None = None,
               rope_theta: float = 10000.0) -> None:
    """Write `tensors` (HF names and layout) the way convert_hf_to_gguf.py would: renamed, Llama's
    q/k permuted, 2-D weights Q8_0 when `quant` (norms and biases stay F32)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(128)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(TINY["vocab"])
    tok = tokenizer or {"model": "gpt2", "tokens": [f"t{i}" for i in range(TINY["vocab"])], "merges": []}
    w.add_tokenizer_model(tok["model"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok.get("types", [1] * len(tok["tokens"])))
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    if tok.get("merges"):
        w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok.get("bos", 0))
    w.add_eos_token_id(tok.get("eos", 1))
    w.add_chat_template("{{ messages }}")
    for name, value in tensors.items():
        if arch == "llama" and "q_proj" in name:
            value = llama_permute(value, TINY["heads"], TINY["heads"])
        elif arch == "llama" and "k_proj" in name:
            value = llama_permute(value, TINY["heads"], TINY["kv_heads"])
        if quant and value.ndim == 2:
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(value))
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
