"""The model itself: exact against transformers, and invariant to how tokens are packed."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from qrun.errors import ModelLoadError
from qrun.loader import load_model
from qrun.kv_cache import KVCache, KVCacheSpec
from qrun.model import AttentionMetadata

BLOCK = 16


def forward_chunks(loaded, pieces, block_tables, num_blocks=64):
    """Run `pieces` — a list of steps, each a list of (seq index, token ids) — through the model.

    Every sequence's K/V go to the blocks its row of `block_tables` names. Returns, per
    sequence, the float32 logits of all its tokens in order.
    """
    model = loaded.model
    kv = KVCache(loaded.config, num_blocks, BLOCK, KVCacheSpec(loaded.dtype), "cpu")
    done = {}
    logits = {}
    for step in pieces:
        ids, positions, spans = [], [], []
        for seq, tokens in step:
            start = done.get(seq, 0)
            ids += tokens
            positions += range(start, start + len(tokens))
            spans.append((start, start + len(tokens)))
            done[seq] = start + len(tokens)
        meta = AttentionMetadata.build(spans, [block_tables[s] for s, _ in step], BLOCK)
        with torch.inference_mode():
            out = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), meta, kv))
        starts = meta.query_start_loc.tolist()
        for (seq, _), a, b in zip(step, starts, starts[1:]):
            logits.setdefault(seq, []).append(out[a:b])
    return {seq: torch.cat(parts) for seq, parts in logits.items()}


def hf_logits(folder, token_ids, **kwargs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tiny_checkpoints, family):
    folder = tiny_checkpoints[family]
    loaded = load_model(folder, dtype="float32")
    tokens = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = forward_chunks(loaded, [[(0, tokens)]], [list(range(10))])[0]
    ref = hf_logits(folder, tokens)
    assert (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max() <= 1e-3


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(tiny_checkpoints["llama"], dtype="float32")


def random_tokens(n, seed):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_flat_batch_equals_each_sequence_alone(tiny):
    seqs = [random_tokens(n, seed) for seed, n in enumerate([3, 200, 1, 40])]
    tables = [[0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [15, 16, 17]]
    together = forward_chunks(tiny, [[(i, s) for i, s in enumerate(seqs)]], tables)
    for i, s in enumerate(seqs):
        alone = forward_chunks(tiny, [[(0, s)]], [tables[i]])[0]
        assert (together[i] - alone).abs().max() <= 1e-5


def test_flat_batch_costs_exactly_its_tokens(tiny, monkeypatch):
    rows = []
    embed = tiny.model.embed_tokens
    monkeypatch.setattr(embed, "forward", lambda ids, f=embed.forward: rows.append(ids.shape[0]) or f(ids))
    forward_chunks(tiny, [[(0, random_tokens(3, 0)), (1, random_tokens(200, 1)), (2, random_tokens(1, 2))]],
                   [[0], list(range(1, 14)), [14]])
    assert rows == [204]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_piece(tiny, chunk):
    tokens = random_tokens(150, 3)
    table = [list(range(10))]
    whole = forward_chunks(tiny, [[(0, tokens)]], table)[0]
    steps = [[(0, tokens[i:i + chunk])] for i in range(0, len(tokens), chunk)]
    chunked = forward_chunks(tiny, steps, table)[0]
    assert (whole - chunked).abs().max() <= 1e-5


def test_decodes_of_different_lengths_batch_exactly(tiny):
    """Prefill three sequences, then decode all three together for several steps."""
    prompts = [random_tokens(n, 10 + n) for n in (5, 33, 17)]
    extra = [random_tokens(6, 20 + i) for i in range(3)]
    tables = [[4, 9, 2], [0, 7, 3, 11], [5, 1, 8]]
    steps = [[(i, p) for i, p in enumerate(prompts)]]
    steps += [[(i, [extra[i][t]]) for i in range(3)] for t in range(6)]
    batched = forward_chunks(tiny, steps, tables)
    for i in range(3):
        alone = forward_chunks(tiny, [[(0, prompts[i] + extra[i])]], [tables[i]])[0]
        assert (batched[i] - alone).abs().max() <= 1e-5


def test_scattered_block_table_equals_contiguous(tiny):
    tokens = random_tokens(120, 4)
    contiguous = forward_chunks(tiny, [[(0, tokens)]], [list(range(8))])[0]
    blocks = list(range(40))
    random.Random(0).shuffle(blocks)
    scattered = forward_chunks(tiny, [[(0, tokens)]], [blocks[:8]])[0]
    assert (contiguous - scattered).abs().max() <= 1e-5


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_gguf):
    loaded = load_model(smollm2_gguf, dtype="float32")
    tokens = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    ours = forward_chunks(loaded, [[(0, tokens)]], [list(range(10))])[0]
    ref = hf_logits(smollm2_gguf.parent, tokens, gguf_file=smollm2_gguf.name)
    assert (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max() <= 1e-3


# -- bad input -----------------------------------------------------------------------------

def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope")


def test_folder_without_config_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(folder)


def test_corrupt_config_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(folder)


def test_truncated_safetensors_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(folder)


def test_unsupported_architecture_names_it_and_the_supported_ones(tiny_llama_dir, tmp_path):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_model(folder)


def test_missing_tokenizer_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(folder)


def test_unknown_alias_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="not found.*alias"):
        load_model("smollm9-1t")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32(tiny_llama_dir, tiny, dtype):
    half = load_model(tiny_llama_dir, dtype=dtype)
    assert half.model.layers[0].mlp.gate_up_proj.weight.dtype == getattr(torch, dtype)
    tokens = random_tokens(60, 8)
    ref = forward_chunks(tiny, [[(0, tokens)]], [list(range(4))])[0].log_softmax(-1)
    ours = forward_chunks(half, [[(0, tokens)]], [list(range(4))])[0].log_softmax(-1)
    assert (ours - ref).abs().max() < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
