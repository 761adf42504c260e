"""GGUF loading: weights, config and tokenizer must equal what Hugging Face loads from the same file."""

from __future__ import annotations

import importlib.util

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from qrun.config import ModelConfig
from qrun.errors import ModelLoadError
from qrun.gguf import open_gguf
from tiny_gguf import TINY, llama_permute, tiny_hf_tensors, write_gguf


def _q8_roundtrip(x: np.ndarray) -> np.ndarray:
    t = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(x, t), t).reshape(x.shape)


@pytest.mark.parametrize("quant", [False, True], ids=["f32", "q8_0"])
def test_written_llama_round_trips_to_hf_tensors(tmp_path, quant):
    hf = tiny_hf_tensors()
    write_gguf(tmp_path / "tiny.gguf", "llama", hf, quant=quant)
    got = dict(open_gguf(tmp_path / "tiny.gguf").tensors())
    assert set(got) == set(hf)
    for name, want in hf.items():
        # Q8_0 blocks run along rows, so quantizing commutes with the row permutation.
        if quant and want.ndim == 2:
            want = _q8_roundtrip(want)
        assert got[name].dtype == torch.float32
        assert tuple(got[name].shape) == want.shape, name
        np.testing.assert_array_equal(got[name].numpy(), want, err_msg=name)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_types_dequantize_as_gguf_quants_does(kind):
    from gguf.constants import GGML_QUANT_SIZES

    from qrun.gguf import _BLOCK_VALUES

    kind_type = gguf.GGMLQuantizationType[kind]
    block, block_bytes = GGML_QUANT_SIZES[kind_type]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (8, 512 // block * block_bytes), dtype=np.uint8)  # any scales: subnormal, inf, NaN
    cases = [raw]
    if block == 32:  # gguf quantizes these (not the K types)
        cases.append(gguf.quants.quantize(rng.standard_normal((8, 512)).astype(np.float32) * 5, kind_type))
    for blocks in cases:
        with np.errstate(invalid="ignore", over="ignore"):
            expected = gguf.quants.dequantize(blocks, kind_type).reshape(-1, block)
        ours = _BLOCK_VALUES[kind](torch.from_numpy(blocks.copy())).numpy()
        assert np.array_equal(ours, expected, equal_nan=True)


def test_q_proj_permutation_is_undone(tmp_path):
    hf = tiny_hf_tensors(seed=1)
    write_gguf(tmp_path / "tiny.gguf", "llama", hf)
    got = dict(open_gguf(tmp_path / "tiny.gguf").tensors())
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_permute(q, TINY["heads"], TINY["heads"]), q)  # the test means something
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    np.testing.assert_array_equal(got["model.layers.1.self_attn.k_proj.weight"].numpy(),
                                  hf["model.layers.1.self_attn.k_proj.weight"])


def test_qwen2_keeps_qk_rows_and_biases_as_written(tmp_path):
    hf = tiny_hf_tensors(seed=2, bias=True)
    write_gguf(tmp_path / "qwen.gguf", "qwen2", hf)
    model = open_gguf(tmp_path / "qwen.gguf")
    assert model.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    got = dict(model.tensors())
    for name, want in hf.items():
        np.testing.assert_array_equal(got[name].numpy(), want, err_msg=name)
    assert ModelConfig.from_hf(model.hf_config).attention_bias


def test_written_file_config_is_hf_shaped_and_untied_with_output_weight(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", "llama", tiny_hf_tensors())
    model = open_gguf(tmp_path / "tiny.gguf")
    cfg = ModelConfig.from_hf(model.hf_config)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == \
        ("LlamaForCausalLM", TINY["vocab"], TINY["hidden"], TINY["ffn"])
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert cfg.max_position_embeddings == 128 and not cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert model.tokenizer_config["chat_template"] == "{{ messages }}"


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path):
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for Llama 3.1 (factor 8).
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    head_dim = TINY["hidden"] // TINY["heads"]
    theta = 500000.0
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    divisors = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    assert len(set(divisors)) == 3  # all three regimes are exercised
    write_gguf(tmp_path / "l3.gguf", "llama", tiny_hf_tensors(),
                extra={"rope_freqs.weight": np.array(divisors, np.float32)}, rope_theta=theta)
    model = open_gguf(tmp_path / "l3.gguf")
    assert model.hf_config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in dict(model.tensors())
    assert ModelConfig.from_hf(model.hf_config).rope_scaling["rope_type"] == "llama3"


def test_unsupported_architecture_is_named_in_the_error(tmp_path):
    write_gguf(tmp_path / "phi.gguf", "phi3", {"model.norm.weight": np.ones(32, np.float32)})
    with pytest.raises(ModelLoadError, match=r"'phi3'.*llama.*qwen2"):
        open_gguf(tmp_path / "phi.gguf")


def test_bad_magic_is_reported_as_corrupt(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(1024))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf is truncated or corrupt.*re-download"):
        open_gguf(bad)


def test_truncated_written_file_is_reported_as_corrupt(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", "llama", tiny_hf_tensors())
    data = (tmp_path / "tiny.gguf").read_bytes()
    for cut in (len(data) // 2, len(data) - 1, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            open_gguf(tmp_path / "cut.gguf")


def test_metadata_reads_as_ggufs_own_reader_reads_it(tmp_path):
    tokens = ["", "t1", "\u00e9t\u00e9", "\U0001F600", " x" * 40] + [f"t{i}" for i in range(5, TINY["vocab"])]
    write_gguf(tmp_path / "tiny.gguf", "llama", tiny_hf_tensors(),
               tokenizer={"model": "gpt2", "tokens": tokens, "merges": ["t 1", "\u00e9 t"]})
    theirs = {name: field.contents() for name, field in gguf.GGUFReader(tmp_path / "tiny.gguf").fields.items()
              if not name.startswith("GGUF.")}
    assert open_gguf(tmp_path / "tiny.gguf")._metadata == theirs
    assert theirs["tokenizer.ggml.tokens"][:5] == tokens[:5]


def test_file_cut_inside_its_vocabulary_is_reported_as_corrupt(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", "llama", tiny_hf_tensors())
    data = (tmp_path / "tiny.gguf").read_bytes()
    start = data.index(b"tokenizer.ggml.tokens")
    for cut in range(start + 30, start + 30 + 12 * TINY["vocab"], 7):  # lengths and bytes of the strings
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="cut.gguf is truncated or corrupt"):
            open_gguf(tmp_path / "cut.gguf")


def test_missing_required_metadata_is_reported(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="missing metadata key 'llama.embedding_length'"):
        open_gguf(tmp_path / "meta.gguf")


def _spm_vocab() -> dict:
    """A tiny sentencepiece-style vocabulary (scores, byte fallback, ▁ for spaces), no merges."""
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "lo", "▁hel", "▁hello", "▁w", "or",
             "▁wor", "ld", "▁world", "ll", "he"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1, "eos": 2}


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = _spm_vocab()
    hf = tiny_hf_tensors()
    hf["model.embed_tokens.weight"] = np.zeros((len(tok["tokens"]), TINY["hidden"]), np.float32)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    write_gguf(tmp_path / "spm.gguf", "llama", hf, tokenizer=tok)
    model = open_gguf(tmp_path / "spm.gguf")
    assert model.tokenizer_config["add_bos_token"] is True  # llama.cpp's default for sentencepiece
    ours = model.tokenizer()
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", " hello", "hello  world!", "é hello", "</s>hello<s> world", "ll he"]:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text), text
        assert ids[0] == 1
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


# --------------------------------------------------------------------------- the real SmolLM2 file

@pytest.fixture(scope="module")
def smol_path(request) -> Path:
    try:
        return Path(request.getfixturevalue("smollm2_gguf"))
    except pytest.FixtureLookupError:
        from qrun.sources import fetch_alias
        return fetch_alias("smollm2-135m")


@pytest.fixture(scope="module")
def smol(smol_path):
    return open_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_tokenizer(smol_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_state_dict(smol, smol_path):
    transformers = pytest.importorskip("transformers")
    where = dict(pretrained_model_name_or_path=str(smol_path.parent), gguf_file=smol_path.name)
    if importlib.util.find_spec("accelerate"):  # from_pretrained needs it for a GGUF
        ref = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).state_dict()
    else:  # the same loader from_pretrained calls, minus accelerate's placement
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(**where))
        ref = load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=model)["tensors"]
        ref.setdefault("lm_head.weight", ref["model.embed_tokens.weight"])
    seen = set()
    for name, tensor in smol.tensors():
        assert name in ref, name
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    # Tied: qrun yields no lm_head; transformers' is the embedding itself.
    assert set(ref) - seen == {"lm_head.weight"}
    torch.testing.assert_close(ref["lm_head.weight"], ref["model.embed_tokens.weight"])


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smol, smol_path):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoConfig.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    ours = smol.hf_config
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "head_dim"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps)
    assert ours["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"]
                                               if getattr(ref, "rope_parameters", None) else ref.rope_theta)
    assert ours["tie_word_embeddings"] is True and ours["rope_scaling"] is None
    ModelConfig.from_hf(ours)  # accepted by qrun as is


SAMPLES = [
    "Hello, world!",
    " leading space and  double  spaces",
    "\tTabs\nand newlines\n\n",
    "Unicode: café naïve 日本語 🤗 Ωμέγα",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 12345 and 3.14159, year 2024",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>qrun<file_sep>",
    "",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_tokenizer_matches_transformers(smol, hf_tokenizer, text):
    ours = smol.tokenizer()
    ids = ours.encode(text).ids
    assert ids == hf_tokenizer.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_special_tokens_stay_whole(smol):
    ids = smol.tokenizer().encode("<|im_start|>assistant<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2


@pytest.mark.slow
def test_smollm2_tokenizer_config_has_chat_template_and_special_tokens(smol):
    cfg = smol.tokenizer_config
    assert "<|im_start|>" in cfg["chat_template"]
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False


@pytest.mark.slow
def test_truncated_smollm2_is_reported_as_corrupt(smol_path, tmp_path):
    cut = tmp_path / "half.gguf"
    with open(smol_path, "rb") as src:
        cut.write_bytes(src.read(smol_path.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="half.gguf is truncated or corrupt"):
        open_gguf(cut)
