"""The "what fits on my card" planner: its arithmetic agrees with what the engine really allocates
and with the bytes of real weights, and `qrun info --gpu-memory` plans from config.json alone."""

import json
import shutil

import pytest
import torch

from qrun.cli import main
from qrun.config import ModelConfig
from qrun.llm import LLM
from qrun.loader import load_model, read_model_config
from qrun.kv_cache import KVCacheSpec
from qrun.memory_plan import CARDS, card_named, plan, weight_bytes

LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False}


@pytest.mark.parametrize("max_num_seqs", [64, 2])  # 2: the cap at what the sequence slots can use
def test_planned_kv_tokens_equal_what_the_engine_allocates_for_the_same_budget(tiny_llama_dir, max_num_seqs):
    config = ModelConfig.from_hf(read_model_config(tiny_llama_dir))
    settings = dict(dtype=torch.float32, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    empty = plan(config, 0, **settings)
    # 1 MiB for the cache: 2,048 tokens at 512 bytes each, unless 2 sequences x 512 tokens cap it
    planned = plan(config, empty.weights.total + empty.reserve + 2**20, **settings)
    assert planned.kv_budget == 2**20 and planned.kv_tokens == (2048 if max_num_seqs == 64 else 1024)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory=planned.kv_budget,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.block_manager.num_blocks * engine.config.block_size == planned.kv_tokens
    assert tuple(engine.runner.kv_cache.k.shape[1:3]) == (planned.kv_tokens // 16, 16)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_dense_weight_bytes_equal_the_loaded_models_tensors(tiny_checkpoints, family):
    loaded = load_model(tiny_checkpoints[family], dtype="float16", device="cpu", fuse_projections=False)
    unique = {id(p): p for p in loaded.model.parameters()}
    real = sum(p.numel() * p.element_size() for p in unique.values())
    assert weight_bytes(loaded.config, torch.float16).total == real


def test_a_quantized_plan_shrinks_the_weights_and_grows_the_cache():
    config = ModelConfig.from_hf(LLAMA_3_8B)
    dense = plan(config, 24 * 2**30)
    four_bit = plan(config, 24 * 2**30, linear_bpw=4.0, head_bpw=6.11)
    assert 14.9 < dense.weights.total / 2**30 < 15.0  # 8.03 B parameters in float16
    assert four_bit.weights.total < dense.weights.total / 3
    assert four_bit.kv_tokens > dense.kv_tokens
    # 128 KiB of K/V per token in float16 (32 layers x 2 x 8 heads x 128 x 2 bytes)
    assert KVCacheSpec(torch.float16).bytes_per_token(config) == 128 * 1024
    assert dense.concurrent_sequences(8192) == dense.kv_tokens // 8192
    # A batch-1 step reads the weights (the embedding's one row aside) and the context's K/V.
    card = CARDS["rtx4090"]
    expected = card.bandwidth / (dense.weights.total - dense.weights.embedding + 1000 * 128 * 1024)
    assert dense.decode_tokens_per_second(card.bandwidth, 1000) == pytest.approx(expected)
    assert not plan(config, 8 * 2**30).fits
    int4_cache = plan(config, 24 * 2**30, kv_cache_dtype="int4")
    assert int4_cache.kv_tokens / dense.kv_tokens == pytest.approx(3.2, abs=0.02)


def test_info_plans_a_card_from_config_json_alone(tmp_path, capsys):
    folder = tmp_path / "llama-3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_3_8B))
    assert main(["info", str(folder), "--gpu", "rtx4090", "--bits", "4.0"]) == 0
    out = capsys.readouterr().out
    planned = plan(ModelConfig.from_hf(LLAMA_3_8B), CARDS["rtx4090"].memory, linear_bpw=4.0, head_bpw=6.11)
    assert f"{planned.kv_tokens:,} tokens" in out
    assert "tok/s" in out and "rtx4090" in out
    assert main(["info", str(folder), "--gpu-memory", "8GiB"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_info_plan_rejects_unknown_cards_and_bits_without_a_card(tmp_path, capsys, tiny_llama_dir):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, folder)
    assert main(["info", str(folder), "--gpu", "rtx9999"]) == 2
    assert "rtx4090" in capsys.readouterr().err  # the known cards are listed
    assert main(["info", str(folder), "--bits", "4.0"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err


@pytest.mark.parametrize("device_name, memory_gib, card", [
    ("NVIDIA GeForce RTX 4090", 24, "rtx4090"), ("NVIDIA A100-SXM4-80GB", 80, "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", 40, "a100-40gb"), ("Tesla T4", 15, "t4"), ("NVIDIA GeForce RTX 4060 Ti", 16, "rtx4060ti"),
    ("NVIDIA A10", 24, "a10"), ("NVIDIA L40S", 48, None), ("NVIDIA GeForce RTX 4070 Ti", 12, None),
])
def test_cuda_device_names_map_to_known_cards_by_whole_model_name(device_name, memory_gib, card):
    found = card_named(device_name, memory_gib * 2**30)
    assert (found.name if found else None) == card
