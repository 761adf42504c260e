"""The qrun command line, run in-process on a tiny random model (the real model only in slow tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from qrun.cli import main
from qrun.options import engine_args_from, parse_memory, sampling_params_from
from qrun.errors import QrunError

# A small cache keeps model loading quick; the tiny model's context is 512 tokens.
ENGINE = ["--kv-cache-memory", "8MiB", "--device", "cpu"]


def test_parse_memory():
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("500MB") == 500_000_000
    assert parse_memory("1.5 kib") == 1536
    assert parse_memory("4096") == 4096
    assert parse_memory("0.2") == 0.2
    for bad in ("lots", "2XB", "0", "-1GB"):
        with pytest.raises(Exception, match="memory size|fraction"):
            parse_memory(bad)


def test_flag_helpers_keep_unset_flags_out():
    import argparse

    from qrun.options import add_engine_arguments, add_sampling_arguments

    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    args = parser.parse_args(["--temperature", "0", "--stop", "a", "--stop", "b", "--no-prefix-caching",
                              "--kv-cache-memory", "1MiB"])
    params = sampling_params_from(args, max_tokens=5)
    assert (params.temperature, params.stop_strings, params.max_tokens, params.top_p) == (0, ("a", "b"), 5, 1.0)
    assert engine_args_from(args) == {"enable_prefix_caching": False, "kv_cache_memory": 2**20}
    assert engine_args_from(parser.parse_args([])) == {}


def test_generate_prompt_streams_text_to_stdout(tiny_llama_dir, capsys):
    assert main(["generate", str(tiny_llama_dir), "hello", "--max-tokens", "5", "--temperature", "0",
                 "--ignore-eos", *ENGINE]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.strip()
    assert "5 tokens" in err and "tokens/s" in err and "finish: length" in err


def test_generate_batch_keeps_order_and_reports_bad_lines(tiny_llama_dir, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(textwrap.dedent("""\
        {"prompt": "one", "max_tokens": 3, "id": "a"}
        {"prompt": "broken
        {"messages": [{"role": "user", "content": "two"}], "max_tokens": 6, "ignore_eos": true}

        {"prompt": "x", "max_token": 3}
        {"prompt": "y", "max_tokens": 100000}
        {"prompt": "z", "temperature": "hot"}
        {"prompt": "three", "max_tokens": 2, "temperature": 0}
        """))
    target = tmp_path / "out.jsonl"
    assert main(["generate", str(tiny_llama_dir), "--input", str(source), "--output", str(target),
                 "--ignore-eos", *ENGINE]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 5, 6, 7, 8]
    assert [("error" in r) for r in records] == [False, True, False, True, True, True, False]
    assert records[0]["id"] == "a" and records[0]["completion_tokens"] == 3
    assert records[2]["completion_tokens"] == 6 and records[2]["finish_reason"] == "length"
    for number in (2, 5, 6, 7):
        assert f"in.jsonl:{number}:" in err
    assert "unknown field 'max_token'" in err and "exceeds" in err
    assert "3 requests (4 skipped)" in err and "tokens/s" in err
    assert not list(tmp_path.glob(".out.jsonl.*"))  # the temporary file was renamed into place


def test_generate_batch_answers_say_which_stop_ended_each_request(tiny_llama_dir, tmp_path):
    from qrun.llm import LLM
    from qrun.sampling_params import SamplingParams

    llm = LLM(str(tiny_llama_dir), kv_cache_memory=8 * 2**20, device="cpu")
    free = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        progress=False)[0]
    stop_string = free.text[len(free.text) // 2:][:2]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests = [{"prompt": "stop here", "stop": [stop_string]},
                {"prompt": "stop here", "stop_token_ids": [free.token_ids[2]]}, {"prompt": "stop here"}]
    source.write_text("".join(json.dumps(request) + "\n" for request in requests))
    assert main(["generate", str(tiny_llama_dir), "--input", str(source), "--output", str(target), "--temperature", "0",
                 "--max-tokens", "8", "--ignore-eos", *ENGINE]) == 0
    by_string, by_token, unstopped = [json.loads(line) for line in target.read_text().splitlines()]
    assert (by_string["finish_reason"], by_string["stop_string"], by_string["stop_token_id"]) == (
        "stop", stop_string, None)
    assert stop_string not in by_string["text"] and free.text.startswith(by_string["text"])
    assert (by_token["finish_reason"], by_token["stop_string"], by_token["stop_token_id"]) == (
        "stop", None, free.token_ids[2])
    assert (unstopped["finish_reason"], unstopped["stop_string"], unstopped["stop_token_id"]) == ("length", None, None)


def test_generate_batch_strict_fails_without_output(tiny_llama_dir, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "ok", "max_tokens": 2}\n[1, 2]\n')
    target = tmp_path / "out.jsonl"
    assert main(["generate", str(tiny_llama_dir), "--input", str(source), "--output", str(target), "--strict",
                 *ENGINE]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qrun: error:") and "in.jsonl:2: not a JSON object" in err
    assert len(err.strip().splitlines()) == 1 and not target.exists()


def test_errors_are_one_line_with_exit_codes(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qrun: error: model") and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["generate", "m", "hi", "--input", "x.jsonl"]) == 2  # prompt and --input are exclusive
    assert main(["generate", "m", "hi", "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["generate", "m", "--kv-cache-memory", "lots"])
    assert usage.value.code == 2
    with pytest.raises(QrunError):  # --debug lets the exception (and its traceback) through
        main(["generate", str(tmp_path / "missing"), "hi", "--debug"])


@pytest.mark.parametrize("command", ["generate", "chat", "info"])
def test_help_has_examples(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert f"qrun {command} " in capsys.readouterr().out.split("examples:")[1]


def test_info_shows_size_and_kv_capacity(tiny_llama_dir, capsys):
    assert main(["info", str(tiny_llama_dir), "--kv-cache-memory", "1MiB", "--block-size", "16", "--dtype", "float32",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "2 layers" in out and "float32" in out
    # 2 layers x 2 (K, V) x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token -> 2048 tokens in 1 MiB.
    assert "2,048 tokens" in out and "32.00 bits per weight" in out
    assert "512 B per token" in out  # bytes, labelled as bytes


def test_info_reports_the_tokens_a_quantized_cache_holds(tiny_llama_dir, capsys):
    # int4 with head_dim 16: 8 bytes of codes + a float16 scale and zero per head and token:
    # 2 layers x 2 x 2 heads x 12 bytes = 96 bytes per token -> 10,922 tokens in 1 MiB, 10,912 in blocks of 16.
    assert main(["info", str(tiny_llama_dir), "--kv-cache-memory", "1MiB", "--kv-cache-dtype", "int4",
                 "--max-num-seqs", "64", "--dtype", "float32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "10,912 tokens (int4)" in out and "96 B per token" in out


def test_info_kv_tokens_are_capped_as_the_engine_caps_them(tiny_llama_dir, capsys):
    # One sequence of at most 512 tokens can use 512 tokens of cache, whatever the budget.
    assert main(["info", str(tiny_llama_dir), "--kv-cache-memory", "1MiB", "--max-num-seqs", "1",
                 "--max-num-batched-tokens", "64", "--dtype", "float32", "--device", "cpu"]) == 0
    assert "512 tokens (float32) in 1.0 MiB" in capsys.readouterr().out


def test_external_subcommand_is_imported_only_when_used(tmp_path, monkeypatch, capsys):
    import qrun.cli as cli

    (tmp_path / "fake_qrun_cmd.py").write_text(textwrap.dedent("""\
        def add_fake_arguments(parser):
            parser.add_argument("--times", type=int, default=1)
        def run_fake(args):
            print("ran " * args.times)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "EXTERNAL_COMMANDS", (
        ("fake", "fake_qrun_cmd", "add_fake_arguments", "run_fake", "a fake command"),
        ("absent", "no_such_module_here", "add", "run", "not installed"),
    ))
    cli.build_parser(["generate"])
    assert "fake_qrun_cmd" not in sys.modules
    assert main(["fake", "--times", "2"]) == 0
    assert capsys.readouterr().out == "ran ran \n"
    with pytest.raises(SystemExit):
        main(["absent"])


@pytest.mark.slow
def test_real_model_knows_paris():
    result = subprocess.run(["qrun", "generate", "smollm2-135m", "The capital of France is", "--max-tokens", "8",
                             "--temperature", "0"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "tokens/s" in result.stderr


def test_a_config_claiming_more_layers_than_the_weights_fails_at_once(tiny_llama_dir, tmp_path, capsys):
    import json
    import shutil
    import time

    folder = tmp_path / "absurd"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1_000_000_000
    (folder / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    assert main(["generate", str(folder), "hi", "--max-tokens", "1", "--device", "cpu"]) == 1
    assert time.monotonic() - start < 30  # building a billion layers would take hours
    err = capsys.readouterr().err
    assert "num_hidden_layers=1000000000" in err and "layers 0..1 (2 of them)" in err


def test_help_and_version_import_neither_torch_nor_triton():
    import subprocess
    import sys

    probe = ("import sys\nfrom qrun.cli import main\nfor argv in (['--help'], ['--version'], ['generate', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_loading_and_generating_leave_torch_compile_unimported(tiny_llama64_dir):
    # torch._dynamo takes 1.3-1.8 s to import, which every `qrun` command paid; the C++ steps never need it
    probe = (f"import sys\nfrom qrun import LLM, SamplingParams\n"
             f"llm = LLM({str(tiny_llama64_dir)!r}, kv_cache_memory=8 << 20, device='cpu')\n"
             "llm.generate(['hello'], SamplingParams(max_tokens=4), progress=False)\n"
             "print('torch._dynamo' in sys.modules, llm.engine.runner.cpu_model is not None)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    dynamo_imported, cpp_steps = result.stdout.strip().splitlines()[-1].split()
    if cpp_steps == "False":
        pytest.skip("no C++ steps here: decode steps compile")
    assert dynamo_imported == "False"
