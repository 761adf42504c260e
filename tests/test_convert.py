"""`qrun convert` end to end on tiny random models: output, accounting, resume, and clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qrun.convert.calibration import CalibrationError
from qrun.convert.job import ConvertError
from qrun.convert.main import convert

FAST = dict(preset="fast", calib_rows=8, calib_len=64)


@pytest.fixture(scope="module")
def converted(tiny_llama_dir, calib_file, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("conv") / "llama-q"
    summary = convert(tiny_llama_dir, out, bits=4.0, head_bits=8, calib=[calib_file], **FAST)
    return out, summary


def test_tied_head_is_quantized_and_stored_untied(tiny_checkpoints, calib_file, tmp_path):
    from qrun.loader import load_model
    from qrun.quant import QuantLinear

    tied = tiny_checkpoints["qwen2"]
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"]
    out = tmp_path / "qwen2-q"
    convert(tied, out, bits=4.0, head_bits=8, calib=[calib_file], **FAST)
    config = json.loads((out / "config.json").read_text())
    assert not config["tie_word_embeddings"] and "lm_head" in config["quantization_config"]["modules"]
    quant = load_model(out, dtype="float32", device="cpu")
    assert isinstance(quant.model.lm_head, QuantLinear)
    assert _sentence_kl(load_model(tied, dtype="float32", device="cpu"), quant) < 0.05


def test_tiny_model_converts_loads_and_generates(converted, tiny_llama_dir):
    from qrun.llm import LLM
    from qrun.loader import load_model
    from qrun.quant import QuantLinear
    from qrun.sampling_params import SamplingParams

    out, summary = converted
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "qrun-exl" and q["target_bpw"] == 4.0
    assert q["achieved_bpw"] <= 4.0 and q["calibration"]["rows"] == 8
    assert "lm_head" in q["modules"] and q["head_bits"] == 8
    for name in ("tokenizer.json", "tokenizer_config.json", "measurement.json", "model.safetensors.index.json"):
        assert (out / name).is_file()

    assert isinstance(load_model(out, dtype="float32", device="cpu", fuse_projections=False)
                      .model.layers[0].self_attn.q_proj, QuantLinear)
    quant = load_model(out, dtype="float32", device="cpu")  # what the engine runs: q/k/v fused
    assert quant.model.layers[0].self_attn.qkv_proj is not None
    assert isinstance(quant.model.lm_head, QuantLinear)
    orig = load_model(tiny_llama_dir, dtype="float32", device="cpu")
    assert _sentence_kl(orig, quant) < 0.05  # random tiny weights, 4 bpw: close to the original

    llm = LLM(str(out), device="cpu", kv_cache_memory=1 << 24)
    result = llm.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                          progress=False)
    assert len(result[0].outputs[0].token_ids) == 5


def test_info_lists_and_counts_every_quantized_projection(converted, capsys, monkeypatch):
    from qrun.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # a layer's name on one line
    out, _ = converted
    config = json.loads((out / "config.json").read_text())
    assert main(["info", str(out), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "1MiB"]) == 0
    text = capsys.readouterr().out
    listed = {line.split()[0] for line in text.splitlines() if line.lstrip().startswith("layers.")}
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fused at run time, listed as stored
    assert listed == {f"layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in projections}


def _sentence_kl(orig, quant) -> float:
    """KL(orig || quant) of the next-token distributions over one sentence."""
    ids = torch.tensor(orig.tokenizer.encode("The jury said it was a fine election."))
    logits = [_logits(m.model, ids) for m in (orig, quant)]
    return float(torch.nn.functional.kl_div(logits[1].log_softmax(-1), logits[0].log_softmax(-1), log_target=True,
                                            reduction="batchmean"))


def _logits(model, ids):
    from qrun.kv_cache import KVCache, KVCacheSpec
    from qrun.model import AttentionMetadata

    t = ids.shape[0]
    cache = KVCache(model.config, 1, t, KVCacheSpec(torch.float32), "cpu")
    meta = AttentionMetadata.build([(0, t)], [[0]], t)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(t), meta, cache))


def test_bpw_accounting_equals_bytes_written(converted):
    out, _ = converted
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layer_bytes, head_bytes, weights = 0, 0, 0
    h, inter = config["hidden_size"], config["intermediate_size"]
    for name in q["modules"]:
        for key, shard in index.items():
            if key.startswith(name + ".") and not key.endswith(".bias"):
                with safe_open(str(out / shard), framework="pt") as f:
                    t = f.get_tensor(key)
                if name == "lm_head":
                    head_bytes += t.numel() * t.element_size()
                else:
                    layer_bytes += t.numel() * t.element_size()
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = h // heads
    weights = config["num_hidden_layers"] * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter)
    assert layer_bytes * 8 / weights == pytest.approx(q["achieved_bpw"], abs=1e-4)
    assert head_bytes * 8 / (h * config["vocab_size"]) == pytest.approx(q["head_bpw"], abs=1e-4)
    total = sum((out / s).stat().st_size for s in set(index.values()))
    assert total == q["file_bytes"]


def test_measurement_is_reused_for_another_target(converted, tiny_llama_dir, calib_file, tmp_path, monkeypatch):
    import qrun.convert.main as main

    out, _ = converted
    monkeypatch.setattr(main, "run_measurement", lambda *a, **k: pytest.fail("measured again"))
    summary = convert(tiny_llama_dir, tmp_path / "q3", bits=3.0, calib=[calib_file],
                      measurement=out / "measurement.json", **FAST)
    assert summary["achieved_bpw"] <= 3.0


def test_low_bit_conversion_uses_rotated_matrices_and_the_model_equals_its_dequantized_weights(
        converted, tiny_llama_dir, calib_file, tmp_path, monkeypatch):
    from torch import nn

    from qrun.loader import load_model
    from qrun.perplexity import window_logprobs
    from qrun.quant import SHARED_INPUTS, QuantLinear

    out = tmp_path / "q28"
    convert(tiny_llama_dir, out, bits=2.8, calib=[calib_file], measurement=converted[0] / "measurement.json", **FAST)
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    assert any(spec["rotated"] for spec in modules.values())  # below 3 bpw the rotated candidates are the cheap ones
    monkeypatch.setenv("QRUN_QUANT_CPU", "ref")  # exact float32 (the fast path: test_quant_linear.py)
    model = load_model(out, dtype="float32", device="cpu").model
    assert any(not isinstance(attn.qkv_input, nn.Identity)  # q/k/v share one rotation of their input
               for attn in (layer.self_attn for layer in model.layers))
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    quantized = window_logprobs(model, ids)

    for module in list(model.modules()):  # the same model with plain linears in the original basis
        for name, child in module.named_children():
            if isinstance(child, QuantLinear):
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = child.dequantized_weight()
                if child.bias is not None:
                    dense.bias.data = child.bias.float()
                setattr(module, name, dense)
            elif name in SHARED_INPUTS:
                setattr(module, name, nn.Identity())
    torch.testing.assert_close(quantized, window_logprobs(model, ids), rtol=1e-4, atol=1e-4)


def test_measurement_from_an_older_version_asks_to_measure_again(converted, tiny_llama_dir, calib_file, tmp_path):
    doc = json.loads((converted[0] / "measurement.json").read_text())
    doc["version"] = 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    with pytest.raises(ConvertError, match="measure again"):
        convert(tiny_llama_dir, tmp_path / "o", bits=4.0, calib=[calib_file], measurement=old, **FAST)
    assert not (tmp_path / "o").exists()


def test_model_in_an_older_format_version_asks_to_convert_again(converted, tmp_path):
    import shutil

    from qrun.errors import ModelLoadError
    from qrun.loader import load_model

    old = tmp_path / "old"
    shutil.copytree(converted[0], old)
    config = json.loads((old / "config.json").read_text())
    config["quantization_config"]["version"] = 1
    (old / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="convert it again"):
        load_model(old, device="cpu")


def test_scale_ranges_stay_float16_in_a_bfloat16_model(converted, monkeypatch):
    from qrun.loader import load_model

    monkeypatch.setenv("QRUN_QUANT_CPU", "ref")  # the packed tensors stay (the fast path drops them once built)
    model = load_model(converted[0], dtype="bfloat16", device="cpu", fuse_projections=False).model
    q_proj = model.layers[0].self_attn.q_proj
    assert q_proj.scale_max.dtype == torch.float16 and q_proj.scales.dtype == torch.uint8
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16


def test_a_cpu_model_holds_its_quantized_weights_once(converted):
    from qrun.loader import load_model
    from qrun.quant import QuantLinear

    model = load_model(converted[0], dtype="float32", device="cpu").model
    unfused = [m for m in model.modules() if isinstance(m, QuantLinear)]  # o_proj, down_proj, the head
    # each multiplies through its CPU matmul's own form of the weights; the packed ones are gone, as the
    # fused q/k/v's and gate/up's are
    assert unfused and all(m.cpu_matmul is not None and m.qweight is None and m.scales is None for m in unfused)
    with pytest.raises(RuntimeError, match="packed weights were released"):
        unfused[0].dequantized_weight()


def test_existing_output_is_refused_without_force(converted, tiny_llama_dir, calib_file):
    out, _ = converted
    before = (out / "config.json").read_bytes()
    with pytest.raises(ConvertError, match="--force"):
        convert(tiny_llama_dir, out, bits=4.0, calib=[calib_file], **FAST)
    assert (out / "config.json").read_bytes() == before


@pytest.mark.parametrize("bits,match", [(1.0, "below the smallest"), (9.0, "above 8"), (0.0, "positive")])
def test_bad_bits_are_clear_errors(tiny_llama_dir, calib_file, tmp_path, bits, match):
    with pytest.raises(ConvertError, match=match):
        convert(tiny_llama_dir, tmp_path / "o", bits=bits, calib=[calib_file], **FAST)
    assert not (tmp_path / "o").exists()


def test_bad_calibration_files_are_clear_errors(tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n ")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 100)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"content": "no text field"}\n')
    cases = [(tmp_path / "missing.txt", "cannot read"), (tmp_path, "cannot read"), (empty, "empty"),
             (binary, "not UTF-8"), (bad_jsonl, "text")]
    for path, match in cases:
        with pytest.raises(CalibrationError, match=match):
            convert(tiny_llama_dir, tmp_path / "o", bits=4.0, calib=[path], **FAST)
    assert not (tmp_path / "o").exists()


def test_jsonl_calibration_is_read(tiny_llama_dir, tmp_path, calib_file, converted):
    jsonl = tmp_path / "c.jsonl"
    text = calib_file.read_text()
    jsonl.write_text("\n".join(json.dumps({"text": text[i:i + 2000]}) for i in range(0, len(text), 2000)))
    summary = convert(tiny_llama_dir, tmp_path / "o", bits=5.0, calib=[jsonl],
                      measurement=converted[0] / "measurement.json", **FAST)
    assert summary["achieved_bpw"] <= 5.0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["quantization_config"]["calibration"]["files"] == ["c.jsonl"]


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
from qrun.convert import job as job_module
from qrun.convert.main import convert

original = job_module.Job.set
def set_then_die(self, key, value):
    original(self, key, value)
    if key == "quantize_done" and value == 0:
        os.kill(os.getpid(), signal.SIGKILL)
job_module.Job.set = set_then_die
convert(sys.argv[1], sys.argv[2], bits=4.0, calib=[sys.argv[3]], measurement=sys.argv[4], preset="fast",
        calib_rows=8, calib_len=64)
"""


def test_killed_conversion_resumes_and_output_is_never_half_written(tiny_llama_dir, calib_file, tmp_path, converted):
    out = tmp_path / "resumed"
    reference, _ = converted  # reuse its measurement: same choices, no measuring here
    measurement = str(reference / "measurement.json")
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tiny_llama_dir), str(out), str(calib_file),
                           measurement],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()  # nothing at OUT until the output is complete
    job = json.loads((tmp_path / ".resumed.qrun-partial" / "job.json").read_text())
    assert job["quantize_done"] == 0 and (tmp_path / ".resumed.qrun-partial" / "final").is_dir()

    summary = convert(tiny_llama_dir, out, bits=4.0, calib=[calib_file], measurement=measurement, **FAST)
    assert summary["resumed"]
    assert not (tmp_path / ".resumed.qrun-partial").exists()
    for shard in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):
        with safe_open(str(out / shard), framework="pt") as a, safe_open(str(reference / shard), framework="pt") as b:
            assert set(a.keys()) == set(b.keys())
            for key in a.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_drift_correction_brings_a_layer_fed_drifted_inputs_closer_to_full_precision(tiny_llama_dir):
    import dataclasses

    from qrun.convert.forward import LayerRunner, Rows, build_layer
    from qrun.convert.gptq import Candidate
    from qrun.convert.presets import PRESETS
    from qrun.convert.quantize import quantize_layer
    from qrun.kernels.rotary import rotary_cos_sin
    from qrun.loader import load_model

    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", fuse_projections=False)
    config = loaded.config
    layer = build_layer(config, {k: v for k, v in loaded.model.layers[1].state_dict().items()})
    g = torch.Generator().manual_seed(0)
    rows, length = 12, 64
    fp_rows = Rows(torch.randn(rows, length, config.hidden_size, generator=g), None)
    # what quantized layers upstream deliver: the same states, systematically distorted
    distortion = torch.randn(config.hidden_size, config.hidden_size, generator=g) / config.hidden_size ** 0.5
    drifted = Rows(fp_rows.x + 0.3 * fp_rows.x @ distortion, None)
    runner = LayerRunner(config, rotary_cos_sin(config.rope_inv_freq(), config.max_model_len, torch.device("cpu")),
                         length, chunk_rows=4)
    cand = Candidate(32, ((3, 1.0),))
    choice = {"layers.1.attn": cand, "layers.1.mlp": cand}
    preset = dataclasses.replace(PRESETS["default"], clip_search=False)
    fp_out, _ = runner.run(layer, fp_rows)
    held = preset.score_rows  # rows never part of the correction's fit
    errors = {}
    for correct in (False, True):
        _, entry, out, _ = quantize_layer(layer, runner, drifted, fp_rows if correct else None, choice, "layers.1",
                                          preset, {})
        errors[correct] = (out.x - fp_out.x)[:held].pow(2).sum().item()  # the MLP block's output
        assert entry["mlp"]["error"] > 0 and (entry["mlp"]["drift"] > 0) == correct
    assert errors[True] < 0.9 * errors[False]


def test_converted_files_get_normal_permissions(converted):
    import stat

    out, _ = converted
    umask = os.umask(0o022)
    os.umask(umask)
    for file in out.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file.name


def test_a_quantization_error_is_one_line_on_stderr_with_exit_1(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    import qrun.convert.main as convert_main
    from qrun.cli import main
    from qrun.convert.gptq import QuantizationError

    def refuse(*args, **kwargs):
        raise QuantizationError("the calibration Hessian is not positive definite even with heavy damping")

    monkeypatch.setattr(convert_main, "_convert", refuse)
    assert main(["convert", str(tiny_llama_dir), str(tmp_path / "out"), "--bits", "4"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.strip() == "qrun: error: the calibration Hessian is not positive definite even with heavy damping"
    assert convert_main.main([str(tiny_llama_dir), str(tmp_path / "out"), "--bits", "4"]) == 1
