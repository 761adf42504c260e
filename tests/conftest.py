"""Shared fixtures: tiny random checkpoints made on the spot, and the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

if not os.path.exists("/dev/nvidiactl"):
    # Without a GPU the Triton kernels run in the interpreter. Triton reads this when first
    # imported, so it is set before anything imports qrun (which imports triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines run eager unless a test asks for compiled decode steps: compiling each test's tiny model
# would cost seconds per engine.
os.environ.setdefault("QRUN_ENFORCE_EAGER", "1")

import qrun  # noqa: E402,F401
import torch  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
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


def make_tiny_checkpoint(folder: Path, family: str, seed: int = 0) -> Path:
    """Save a random 2-layer model of `family` (llama, qwen2, mistral) with transformers."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(root / family, family) for family in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from qrun.sources import fetch_alias

    return fetch_alias("smollm2-135m")


@pytest.fixture(scope="session")
def workload():
    """Requests of the mixed-length benchmark workload, in file order."""
    path = SHARED / "data" / "workloads" / "mixed_lengths.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pytest_configure(config) -> None:
    # Two cores: more threads only contend. Tests compare numbers, never time, so the engine's
    # load-following thread count is fixed too (subprocesses inherit it): a count changing
    # between two runs a test compares could change their last bits.
    threads = min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    os.environ.setdefault("QRUN_THREADS", str(threads))
