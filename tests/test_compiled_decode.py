"""Compiled CPU decode steps (torch.compile): the same tokens as eager mode, and a way back to
eager when the compiler fails."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import qrun.compiled_decode as compiled_decode
from qrun import LLM, SamplingParams
from qrun.convert.main import convert
from qrun.cpu_model import CpuModel
from qrun.kernels import cpu_library, cpu_quant_matmul

GREEDY = dict(temperature=0, ignore_eos=True)


needs_compiler = pytest.mark.skipif(not cpu_library.available(),
                                    reason="torch.compile and the C++ kernels need a C++ compiler")


@pytest.fixture(autouse=True)
def torch_decode_steps(monkeypatch):
    """The compiled torch layer runs where the C++ model does not (qrun/cpu_model.py):
    these tests make it run everywhere."""
    monkeypatch.setattr(CpuModel, "build", classmethod(lambda cls, model, kv_cache: None))


def tiny_prompts(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def compiled_engine(path, **options):
    """An engine whose decode steps all run compiled, compiled before it returns: a step the
    warm-up's graphs do not cover fails rather than running eager."""
    llm = LLM(str(path), enforce_eager=False, **{"kv_cache_memory": 4_000_000, "max_num_seqs": 8, **options})
    llm.engine.runner.compiled.compile_now()
    llm.engine.runner.compiled.stance = "fail_on_recompile"
    return llm


# Inductor's code for torch's AVX2 kernels computes these layers wrongly (torch 2.13): qrun refuses it there
# (test_a_compiled_layer_that_disagrees_with_eager_stays_eager), so compiled = eager is pinned where torch runs AVX-512.
needs_avx512_inductor = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                           reason="qrun refuses Inductor's layers where torch runs AVX2 kernels")


@needs_compiler
@needs_avx512_inductor
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"),
                                                   ("bfloat16", "int4")])
def test_compiled_decode_generates_the_eager_tokens(tiny_llama64_dir, dtype, kv_cache_dtype, monkeypatch):
    prompts = tiny_prompts(6)
    params = [SamplingParams(max_tokens=4 + 5 * i, **GREEDY) for i in range(6)]
    options = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=4_000_000, max_num_seqs=8)
    eager = LLM(str(tiny_llama64_dir), enforce_eager=True, **options)
    compiled = compiled_engine(tiny_llama64_dir, **options)
    layer = compiled.engine.runner.compiled.layer
    calls = []
    compiled.engine.runner.compiled.layer = lambda *args: calls.append(1) or layer(*args)
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params, progress=False)]
    got = [out.outputs[0].token_ids for out in compiled.generate(prompts, params, progress=False)]
    assert layer is not None and calls  # decode steps ran compiled
    assert got == expected


@needs_compiler
@needs_avx512_inductor
def test_a_mixed_bit_model_decodes_compiled_with_the_eager_tokens(tiny_llama64_dir, calib_file, tmp_path,
                                                                  monkeypatch):
    """On torch's int4 kernel, whose inputs are continuous. The VNNI kernel rounds its inputs to
    int8, so the last-bit differences of fused ops can move a rounding step (~1e-3 in this random
    model's flat logits, enough to flip a near-tie): there compiled = eager holds to that rounding,
    not token for token."""
    monkeypatch.setattr(cpu_quant_matmul, "available", lambda: False)
    converted = tmp_path / "llama-q"
    convert(tiny_llama64_dir, converted, bits=3.5, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    prompts = tiny_prompts(4)
    params = [SamplingParams(max_tokens=6 + 4 * i, **GREEDY) for i in range(4)]
    eager = LLM(str(converted), dtype="float32", enforce_eager=True, kv_cache_memory=4_000_000, max_num_seqs=8)
    compiled = compiled_engine(converted, dtype="float32")
    layer = compiled.engine.runner.compiled.layer
    calls = []
    compiled.engine.runner.compiled.layer = lambda *args: calls.append(1) or layer(*args)
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params, progress=False)]
    got = [out.outputs[0].token_ids for out in compiled.generate(prompts, params, progress=False)]
    assert layer is not None and calls
    assert got == expected


@needs_compiler
def test_an_engine_compiles_only_after_many_decode_steps(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(compiled_decode, "COMPILE_AFTER_DECODE_STEPS", 20)
    started = []
    monkeypatch.setattr(compiled_decode.CompiledDecode, "_compile", lambda self: started.append(self.decode_steps))
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=False, kv_cache_memory=4_000_000)
    llm.generate(tiny_prompts(1), SamplingParams(max_tokens=15, **GREEDY), progress=False)
    assert started == []
    llm.generate(tiny_prompts(1), SamplingParams(max_tokens=15, **GREEDY), progress=False)
    assert started == [21]


@needs_compiler
def test_a_failing_compiled_step_falls_back_to_eager(tiny_llama_dir, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler after all")

    monkeypatch.setattr(compiled_decode.CompiledDecode, "_compile", lambda self: setattr(self, "layer", broken))
    prompts = tiny_prompts(3)
    params = SamplingParams(max_tokens=6, **GREEDY)
    eager = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, kv_cache_memory=4_000_000)
    compiled = compiled_engine(tiny_llama_dir, dtype="float32")
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params, progress=False)]
    assert [out.outputs[0].token_ids for out in compiled.generate(prompts, params, progress=False)] == expected
    assert compiled.engine.runner.compiled.layer is None


@needs_compiler
def test_a_step_waits_out_a_trace_of_the_compile_thread_instead_of_failing(tiny_llama_dir, monkeypatch):
    """While FX traces it patches nn.Module.__call__ for the whole process: a step in the engine's thread meanwhile
    ran into the trace (NameError: module is not installed as a submodule) and failed its requests."""
    tracing = threading.Event()

    class SlowToTrace(torch.nn.Module):
        def forward(self, x):
            tracing.set()
            time.sleep(1.0)  # the step starts meanwhile
            return x + 1

    monkeypatch.setattr(compiled_decode.CompiledDecode, "_compile", lambda self: torch.fx.symbolic_trace(SlowToTrace()))
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=False, kv_cache_memory=4_000_000)
    thread = llm.engine.runner.compiled.start()
    tracing.wait()
    done = llm.generate(tiny_prompts(2), SamplingParams(max_tokens=4, **GREEDY), progress=False)
    thread.join()
    assert [out.outputs[0].finish_reason for out in done] == ["length", "length"]


@needs_compiler
def test_a_compiled_layer_that_disagrees_with_eager_stays_eager(tiny_llama_dir, monkeypatch):
    """As Inductor's code for torch's AVX2 kernels did: the warm-up's steps compare it with eager."""
    compile_layer = torch.compile

    def miscompiled(forward, **options):
        layer = compile_layer(forward, **options)
        return lambda *args: tuple(out * 1.5 for out in layer(*args))

    monkeypatch.setattr(compiled_decode.torch, "compile", miscompiled)
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=False, kv_cache_memory=4_000_000)
    llm.engine.runner.compiled.compile_now()
    assert llm.engine.runner.compiled.layer is None
