"""`qrun ppl`: perplexity over non-overlapping windows and KL against a reference."""

import json
import math

import pytest
import torch

from qrun.perplexity import EvalError, add_ppl_arguments, evaluate, run_ppl


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "t.txt"
    path.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 8)
    return path


def test_perplexity_matches_transformers_over_non_overlapping_windows(tiny_llama_dir, text_file):
    import transformers

    from qrun.loader import load_model

    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu")
    result = evaluate(loaded, [str(text_file)], ctx=100, max_tokens=450)
    ids = torch.tensor(loaded.tokenizer.encode(text_file.read_text(), add_special_tokens=False))[:450]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, 450, 100):
            window = ids[start:start + 100]
            logp = hf(window[None]).logits[0].log_softmax(-1)
            nll -= logp[:-1].gather(1, window[1:, None]).sum().item()
            count += len(window) - 1
    assert result["tokens"] == count == 445
    assert result["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert result["kl"] is None and result["bpw"] is None


def test_kl_of_a_model_against_itself_is_zero_and_against_another_is_positive(tiny_checkpoints, text_file):
    from qrun.loader import load_model

    a = load_model(tiny_checkpoints["llama"], dtype="float32", device="cpu")
    same = evaluate(a, [str(text_file)], ctx=64, max_tokens=200, ref=a)
    assert abs(same["kl"]) < 1e-6
    sharper = load_model(tiny_checkpoints["llama"], dtype="float32", device="cpu")
    sharper.model.lm_head.weight.data *= 50  # random tiny models are near uniform; make one confident
    kl = evaluate(a, [str(text_file)], ctx=64, max_tokens=200, ref=sharper)["kl"]
    assert kl > 0.01


def test_json_output_has_ppl_kl_tokens_bpw(tiny_llama_dir, text_file, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_ppl_arguments(parser)
    args = parser.parse_args([str(tiny_llama_dir), "--text", str(text_file), "--ctx", "64", "--max-tokens", "130",
                              "--ref", str(tiny_llama_dir), "--json", "--device", "cpu"])
    assert run_ppl(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"ppl", "kl", "tokens", "bpw"} <= set(out) and out["tokens"] == 127


def test_unusable_text_is_a_clear_error(tiny_llama_dir, tmp_path):
    empty = tmp_path / "e.txt"
    empty.write_text("")
    with pytest.raises(EvalError, match="empty"):
        evaluate(str(tiny_llama_dir), [str(empty)], device="cpu")
    with pytest.raises(EvalError, match="cannot read"):
        evaluate(str(tiny_llama_dir), [str(tmp_path / "nope.txt")], device="cpu")
    with pytest.raises(EvalError, match="matches no file"):
        evaluate(str(tiny_llama_dir), [str(tmp_path / "z*.txt")], device="cpu")
