"""The serving benchmark's own accounting, on a tiny model (never timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qrun import LLM
from qrun.bench import BenchRequest, run_qrun
from qrun.kernels import cpu_library

ROOT = Path(__file__).resolve().parents[1]


def test_qrun_computes_no_padding_and_allocates_only_live_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=4_000_000, max_num_batched_tokens=64)
    requests = [BenchRequest(str(i), chr(65 + i) * (3 + 17 * i), 4 + 3 * i) for i in range(6)]
    result = run_qrun(llm, requests)
    assert result["generated_tokens"] == sum(r.max_tokens for r in requests)
    assert result["padding_tokens"] == 0
    assert result["kv_alloc_over_ceil"] == 1.0


def test_shared_prefix_is_prefilled_once(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=4_000_000, max_num_batched_tokens=64,
              max_num_seqs=4)
    prefix = "a long shared preamble " * 8
    requests = [BenchRequest(str(i), prefix + f"question {i}?", 3) for i in range(8)]
    result = run_qrun(llm, requests)
    assert result["prefill_fraction"] < 0.5
    again = run_qrun(llm, requests)  # each run starts with a cold cache
    assert again["prefill_tokens_computed"] == result["prefill_tokens_computed"]


def test_qrun_bench_command_prints_a_table(tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt": "hello " * i, "max_tokens": 3}) for i in range(1, 5)))
    out = subprocess.run([sys.executable, "-m", "qrun.cli", "bench", str(tiny_llama_dir), "--workload", str(workload),
                          "--kv-cache-memory", "4MB", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tok/s" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["generated_tokens"] == 12


def test_decode_step_bytes_count_each_weight_once_and_one_embedding_row(tiny_llama_dir):
    import torch

    from qrun.bench import decode_step_bytes
    from qrun.kv_cache import KVCacheSpec
    from qrun.loader import load_model

    model = load_model(tiny_llama_dir, dtype="float32", device="cpu").model
    assert not model.config.tie_word_embeddings
    weights = sum(p.numel() for p in model.parameters()) * 4
    embed = model.embed_tokens.weight
    one_row_each = (embed.shape[1] + model.cos_sin.shape[1]) * 4
    config = model.config
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    expected = weights - embed.numel() * 4 + one_row_each + 100 * kv_per_token
    assert decode_step_bytes(model, 100, KVCacheSpec(torch.bfloat16)) == expected


def test_a_run_whose_read_bandwidth_swings_is_flagged_as_not_quiet():
    from qrun.bench import unquiet_warning

    assert unquiet_warning([32.4e9, 32.6e9, 32.1e9]) is None
    assert unquiet_warning([49.4e9]) is None  # one reading says nothing about a spread
    warning = unquiet_warning([49.4e9, 33.5e9, 28.6e9])
    assert warning and "28.6-49.4 GB/s" in warning and "not quiet" in warning


def test_a_run_whose_arithmetic_rate_swings_is_flagged_as_not_quiet():
    """A host can slow a VM's cores while its memory reads steadily: the arithmetic readings flag that run too."""
    from qrun.bench import unquiet_warning

    steady = [32.4e9, 32.6e9, 32.1e9]
    assert unquiet_warning(steady, [160e9, 158e9, 163e9]) is None
    warning = unquiet_warning(steady, [160e9, 90e9])
    assert warning and "90.0-160.0 G multiply-adds/s" in warning and "GB/s" not in warning
    both = unquiet_warning([49.4e9, 28.6e9], [160e9, 90e9])
    assert both and "28.6-49.4 GB/s" in both and "90.0-160.0" in both


@pytest.mark.skipif(not cpu_library.available(), reason="the probe is a C++ kernel")
def test_the_arithmetic_probe_runs_every_multiply_add_it_counts():
    """The probe's sum is its 12 x 16 lanes after exactly `rounds` multiply-adds x -> 0.9999999 x + 1e-8 rounded to
    float32 (each moves a lane near 1 by a float32 step, so one round more or less shows); and the rate it gives is a
    positive count a second."""
    import numpy as np
    import torch

    from qrun.bench import measure_arithmetic_rate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rounds in (0, 1, 36, 37):
            chains = np.float32(1) + np.arange(12, dtype=np.float32) * np.float32(1e-7)
            for _ in range(rounds):  # one rounding a step, as an FMA's
                chains = (chains.astype(np.float64) * np.float32(0.9999999) + np.float32(1e-8)).astype(np.float32)
            assert torch.ops.qrun.multiply_adds(rounds) == pytest.approx(16 * chains.astype(np.float64).sum(),
                                                                           rel=1e-12)
        assert measure_arithmetic_rate(rounds=1 << 12, repeats=1) > 0
    finally:
        torch.set_num_threads(threads)


def load_bench_serving():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "scripts" / "bench_serving.py")
    bench_serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_serving)
    return bench_serving


def test_systems_take_turns_in_reverse_every_other_repeat_and_each_repeats_ratio_is_shown():
    bench_serving = load_bench_serving()
    assert [bench_serving.repeat_order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"],
                                                                                  ["a", "b", "c"]]
    runs = {"a": [{"tokens_per_s": 100.0}, {"tokens_per_s": 80.0}],
            "b": [{"tokens_per_s": 125.0}, {"tokens_per_s": 80.0}]}
    assert bench_serving.repeat_ratios(runs, ["a", "b"]) == "batched tok/s per repeat, x a's: b 1.25x, 1.00x"


def test_a_system_names_its_model_dtype_and_kv_cache_dtype_by_suffixes_that_name_dtypes():
    parse_system = load_bench_serving().parse_system
    assert parse_system("qrun") == ("qrun", "", None, None)
    assert parse_system("qrun:float32") == ("qrun", "", "float32", None)
    assert parse_system("qrun@out/smol-4.0:bfloat16+int8") == ("qrun", "out/smol-4.0", "bfloat16", "int8")
    assert parse_system("qrun_eager@out/a:b+c+int4") == ("qrun_eager", "out/a:b+c", None, "int4")
    assert parse_system("llamacpp@q4_0") == ("llamacpp", "q4_0", None, None)


def test_each_systems_roofline_is_the_rate_its_own_step_bytes_read_at():
    """A step whose bytes fit the last-level cache reads them faster than memory gives: its roofline is the rate
    measured over that many bytes, not over a buffer past the caches."""
    bench_serving = load_bench_serving()
    summary = [{"system": "small", "single_stream_tok_s": 210.0}, {"system": "large", "single_stream_tok_s": 49.0}]
    table = bench_serving.roofline_table(summary, {"small": 100e6, "large": 300e6},
                                         {"small": [40e9, 42e9], "large": [20e9, 21e9]}, [20e9, 21e9],
                                         [160e9, 161e9])
    rows = {line.split()[0]: line.split() for line in table.splitlines()[3:]}
    assert rows["small"][1:] == ["100.0", "42.0", "420.0", "210.0", "50%"]
    assert rows["large"][1:] == ["300.0", "21.0", "70.0", "49.0", "70%"]
    assert "past the caches 21.0 GB/s" in table and "arithmetic 160.0, 161.0 G multiply-adds/s" in table
    assert "WARNING" not in table


def test_a_deep_single_stream_context_is_the_workloads_prompts_cut_to_the_depth(tiny_llama_dir):
    from qrun.tokenizer import Tokenizer

    bench_serving = load_bench_serving()
    tokenizer = Tokenizer.from_folder(tiny_llama_dir, [])
    requests = [BenchRequest("a", "The cat sat on the mat.", 8), BenchRequest("b", "A dog ran far away.", 8)]
    one_round = len(tokenizer.encode("The cat sat on the mat.\n\nA dog ran far away.\n\n", add_special_tokens=False))
    depth = 3 * one_round + 5  # past three rounds of the prompts
    text = bench_serving.deep_prompt(requests, tokenizer, depth)
    assert abs(len(tokenizer.encode(text, add_special_tokens=False)) - depth) <= 1
    assert text.startswith("The cat sat on the mat.") and text.count("A dog ran far away.") == 3
    with pytest.raises(ValueError, match="prompts are empty"):
        bench_serving.deep_prompt([BenchRequest("e", " ", 8)], tokenizer, 10)


def test_a_prefill_profile_labels_the_cpu_products_and_counts_the_librarys_ops_as_torch_ops(tiny_llama_dir):
    """The CPU path's linears are not nn.Linear, and the C++ kernels' ops share the `qrun::` namespace: the profile
    once labelled no matmul time and counted the kernels as Python overhead."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_steps", ROOT / "scripts" / "profile_steps.py")
    profile_steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_steps)
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=4_000_000, max_num_batched_tokens=64)
    requests = [BenchRequest(str(i), "word " * 60, 4) for i in range(4)]
    profile = profile_steps.profile_qrun(llm, requests, steps=2, skip_steps=0)
    assert profile["matmul_s"] > 0 and profile["attention_s"] > 0
    ops = {op["op"] for op in profile["top_ops"]}
    assert ops & {"qrun::paged_attention", "qrun::half_gemv", "qrun::add_rms_norm", "qrun::silu_and_mul"}
