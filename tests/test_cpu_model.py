"""Steps through the C++ model (qrun/cpu_model.py): bit for bit the torch model's logits
and cache, for every linear path it covers, and the torch model wherever it does not cover one."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from qrun import LLM, SamplingParams, cpu_model
from qrun.bench import BenchRequest, run_qrun
from qrun.convert.main import convert
from qrun.cpu_model import CpuModel
from qrun.cpu_linear import GEMV_ROW_LIMITS, GEMV_ROWS, bfloat16_only, gemv_linears
from qrun.kernels import cpu_library, cpu_quant_matmul
from qrun.kernels.argmax import first_max_ref
from qrun.kernels.cpu_draw import draw_cpu
from qrun.kernels.read_streams import READ_STREAMS
from qrun.model import AttentionMetadata, StepLayout
from qrun.quant import vnni_matmuls
from qrun.sampler import RunSampling
from tiny_checkpoint import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")

GREEDY = dict(temperature=0, ignore_eos=True)


def engine(path, **options) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": 4_000_000, "max_num_seqs": 8, **options})


def decode_step_both_ways(llm: LLM, batch: int, half_gemv: bool = True):
    """One decode step of `batch` sequences at different context lengths, through the torch model
    and through the C++ one: (logits, cache) of each."""
    return step_both_ways(llm, [1] * batch, seed=batch, half_gemv=half_gemv)


def random_cache(cache, g: torch.Generator) -> None:
    """Every cache tensor random in its kind's range: codes, float16 scales, float keys and values."""
    with torch.inference_mode():
        for tensor in cache.tensors():
            if tensor.dtype == torch.int8:
                tensor.random_(-127, 128, generator=g)
            elif tensor.dtype == torch.uint8:
                tensor.random_(0, 256, generator=g)
            elif tensor.dtype == torch.float16:
                tensor.uniform_(0.01, 0.1, generator=g)
            else:
                tensor.normal_(generator=g)


def step_both_ways(llm: LLM, query_lens: list[int], seed: int, half_gemv: bool = True, sample_every: int = 1):
    """One step of sequences with these query lengths (1: a decode row; more: a prefill chunk after cached
    tokens) at different context lengths, every `sample_every`-th sequence's last row sampling, through the torch
    model and through the C++ one: (logits of the sampling rows, cache) of each."""
    runner = llm.engine.runner
    model, cache, block_size = runner.model, runner.kv_cache, runner.block_size
    g = torch.Generator().manual_seed(seed)
    lengths = [n + int(torch.randint(0, 3 * block_size, (1,), generator=g)) for n in query_lens]
    width = -(-max(lengths) // block_size)
    tables = [[1 + s * width + i for i in range(width)] for s in range(len(lengths))]
    spans = [(n - q, n) for q, n in zip(query_lens, lengths)]
    layout = StepLayout.of(spans, tables, block_size)
    meta = AttentionMetadata.of(layout)
    ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=g)
    positions = torch.tensor([p for start, end in spans for p in range(start, end)])
    ends = torch.tensor(query_lens).cumsum(0) - 1
    rows = ends[::sample_every].tolist()
    random_cache(cache, g)  # earlier tokens' keys and values (and their scales)
    with torch.inference_mode():
        results = []
        for step in (lambda: model.compute_logits(model(ids, positions, meta, cache)[rows]),
                     lambda: runner.cpu_model.step(ids.tolist(), positions.tolist(), layout, half_gemv, rows)[0]):
            logits = step()
            results.append((logits, [t.clone() for t in cache.tensors()]))
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_cpu_model_equals_the_torch_model_bit_for_bit(tiny_llama64_dir, dtype, batch):
    """bfloat16 covers dense linears' float16 GEMV (up to the rows the load chose) and oneDNN (more)."""
    llm = engine(tiny_llama64_dir, dtype=dtype)
    assert llm.engine.runner.cpu_model is not None
    (torch_logits, torch_cache), (cpp_logits, cpp_cache) = decode_step_both_ways(llm, batch)
    assert torch.equal(cpp_logits, torch_logits)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("query_lens, sample_every", [([40], 1), ([1, 37, 1, 20], 1), ([25, 1, 3], 2)])
def test_a_step_with_prefill_chunks_equals_the_torch_model_bit_for_bit(tiny_llama64_dir, dtype, query_lens,
                                                                      sample_every):
    """Prefill chunks beside decode rows, the head multiplying only the rows that sample (none of a chunk short
    of its prompt's end, here every other sequence's)."""
    llm = engine(tiny_llama64_dir, dtype=dtype)
    (torch_logits, torch_cache), (cpp_logits, cpp_cache) = step_both_ways(llm, query_lens, seed=len(query_lens),
                                                                          sample_every=sample_every)
    assert cpp_logits.shape[0] == len(query_lens[::sample_every])
    assert torch.equal(cpp_logits, torch_logits)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


@functools.cache
def engine_kept_across_examples(path) -> LLM:
    return engine(path, dtype="bfloat16")


@settings(max_examples=8, deadline=None)
@example(batches=[5, 5, 2, 1, 1, 5])
@given(batches=st.lists(st.integers(1, 5), min_size=2, max_size=5))
def test_cpu_model_stays_exact_as_its_kept_buffers_change_size(tiny_llama64_dir, batches):
    """The C++ model keeps its buffers between steps (one engine across examples) and reallocates them
    when the rows change: a stale or shared buffer would show as a difference, and the logits a
    step returned stay as they were after the next."""
    llm = engine_kept_across_examples(tiny_llama64_dir)
    kept = None
    for batch in batches:
        (torch_logits, torch_cache), (cpp_logits, cpp_cache) = decode_step_both_ways(llm, batch)
        assert torch.equal(cpp_logits, torch_logits)
        assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))
        if kept is not None:
            assert torch.equal(*kept)  # the last step's logits, untouched
        kept = (cpp_logits, cpp_logits.clone())


def test_cpu_model_follows_bfloat16_only(tiny_llama64_dir):
    """The rerun of a step whose float16 GEMV overflowed: bfloat16 matmuls at one row too."""
    llm = engine(tiny_llama64_dir, dtype="bfloat16")
    with bfloat16_only(llm.engine.runner.model):
        (torch_logits, _), (cpp_logits, _) = decode_step_both_ways(llm, 1, half_gemv=False)
    assert torch.equal(cpp_logits, torch_logits)


@pytest.mark.skipif(not cpu_quant_matmul.available(), reason="the 4-bit C++ matmul needs AVX512-VNNI")
@pytest.mark.parametrize("query_lens, tile_rows, tile_dequantize_rows, dequantize_rows",
                         [([1], 0, 0, 0), ([1] * 5, 0, 0, 0), ([1] * 5, 4, 0, 0), ([1] * 5, 4, 4, 0),
                          ([1] * 5, 0, 0, 4), ([30, 1, 9], 0, 0, 0), ([30, 1, 9], 4, 4, 20)])
def test_cpu_model_runs_a_mixed_bit_model_as_the_torch_model(tiny_llama64_dir, calib_file, tmp_path,
                                                              monkeypatch, query_lens, tile_rows,
                                                              tile_dequantize_rows, dequantize_rows):
    """Rotated inputs (shared and per linear), act-order permutations, 5-8-bit groups' high digits, a
    quantized head; and on AMX CPUs the tile kernel (codes or weights mode) or oneDNN on the dequantized weights, by
    the rows (forced here); decode rows, and prefill chunks beside them."""
    if tile_rows and not cpu_quant_matmul.tile_rows():
        pytest.skip("no AMX kernel on this machine")
    monkeypatch.setattr(cpu_quant_matmul, "tile_rows", lambda: tile_rows)
    monkeypatch.setattr(cpu_quant_matmul, "tile_dequantize_rows", lambda group, high_plane: tile_dequantize_rows)
    monkeypatch.setattr(cpu_quant_matmul, "dequantize_rows", lambda: dequantize_rows)
    converted = tmp_path / "llama-q"
    convert(tiny_llama64_dir, converted, bits=5.0, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    llm = engine(converted, dtype="bfloat16")
    assert llm.engine.runner.cpu_model is not None
    (torch_logits, torch_cache), (cpp_logits, cpp_cache) = step_both_ways(llm, query_lens, seed=len(query_lens))
    assert torch.equal(cpp_logits, torch_logits)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


@pytest.fixture(scope="module")
def quantized_tiny64(tiny_llama64_dir, calib_file, tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "llama-q"
    convert(tiny_llama64_dir, path, bits=4.0, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    return path


@pytest.mark.skipif(not cpu_quant_matmul.available(), reason="the 4-bit C++ matmul needs AVX512-VNNI")
@pytest.mark.parametrize("streams", READ_STREAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_products_give_the_torch_models_logits_at_every_read_stream_count(quantized_tiny64, monkeypatch,
                                                                               streams, dtype):
    """The VNNI kernel stores the MLP's silu(gate) * up as it multiplies gate/up: at one or two rows the threads
    claim gate tiles beside their up tiles, in runs by the stream count; three threads share the 32 pairs
    unevenly."""
    monkeypatch.setattr(cpu_model, "fastest_read_streams", lambda sweep, repeats: streams)
    llm = engine(quantized_tiny64, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for batch in (1, 2):
            (torch_logits, torch_cache), (cpp_logits, cpp_cache) = decode_step_both_ways(llm, batch)
            assert torch.equal(cpp_logits, torch_logits)
            assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not cpu_quant_matmul.available(), reason="the 4-bit C++ matmul needs AVX512-VNNI")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_model_runs_a_quantized_head_as_the_torch_model(calib_file, tmp_path, dtype):
    """A vocabulary of a multiple of 16 gives the head the VNNI kernel's planes (the tiny models' 300
    take the bfloat16 fallback): its two input digits and its high plane. In float32 the head stores
    its logits in the step's kept buffers: the logits a step returned stay as they were after the next
    step of as many rows."""
    checkpoint = make_tiny_checkpoint(tmp_path / "llama", "llama", head_dim=64, vocab_size=320)
    converted = tmp_path / "llama-q"
    convert(checkpoint, converted, bits=4.0, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    llm = engine(converted, dtype=dtype)
    head = llm.engine.runner.model.lm_head.cpu_matmul
    assert head.planes is not None and head.planes[4] is not None and head.input_digits == 2
    kept = None
    for seed, batch in enumerate((1, 5, 5)):
        (torch_logits, torch_cache), (cpp_logits, cpp_cache) = step_both_ways(llm, [1] * batch, seed)
        assert torch.equal(cpp_logits, torch_logits)
        assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))
        if kept is not None:
            assert torch.equal(*kept)  # the last step's logits, untouched
        kept = (cpp_logits, cpp_logits.clone())


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("query_lens", [[1], [1] * 5, [20, 1, 7]])
def test_cpu_model_stores_and_reads_a_quantized_cache_as_the_torch_model(tiny_llama64_dir, kv_cache_dtype,
                                                                          dtype, query_lens):
    """Keys centred and rotated, K and V quantized into the cache (same bytes, same scales); decode rows and a
    prefill chunk's."""
    llm = engine(tiny_llama64_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.cpu_model is not None
    assert llm.engine.runner.kv_cache.layers[0].k_mean is not None
    (torch_logits, torch_cache), (cpp_logits, cpp_cache) = step_both_ways(llm, query_lens, seed=len(query_lens))
    assert torch.equal(cpp_logits, torch_logits)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_cpu_model_gives_each_rows_greedy_token_and_minus_one_where_its_logits_are_not_finite(
        tiny_llama64_dir, dtype, poison):
    """The engine's finiteness check and greedy sampling take these instead of passes of their own."""
    runner = engine(tiny_llama64_dir, dtype=dtype).engine.runner
    layout = StepLayout.of([(0, 1)] * 3, [[1], [2], [3]], runner.block_size)
    with torch.inference_mode():
        runner.model.embed_tokens.weight[6] = poison  # the middle row's token: its row alone goes non-finite
        logits, first_max = runner.cpu_model.step([5, 6, 7], [0, 0, 0], layout)
    assert not logits[1].isfinite().all() and logits[[0, 2]].isfinite().all()
    assert first_max == [first_max_ref(logits[:1]).item(), -1, first_max_ref(logits[2:]).item()]


@pytest.mark.parametrize("drawn", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_run_of_decode_steps_gives_the_tokens_and_cache_of_steps_fed_their_own_tokens(
        tiny_llama64_dir, dtype, batch, drawn):
    """Greedy tokens, or (drawn) tokens drawn as the sampler's draw draws them from each step's logits, beside a
    greedy row."""
    runner = engine(tiny_llama64_dir, dtype=dtype).engine.runner
    steps, block_size = 6, runner.block_size
    starts = [5 + 13 * s for s in range(batch)]  # crossing a block boundary within the run
    tables = [[1 + 4 * s + i for i in range(4)] for s in range(batch)]
    first_ids = [11 * (s + 1) for s in range(batch)]
    draws = None
    if drawn:
        uniforms = torch.rand(steps, batch, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        draws = ([1.3, 0.0, 0.7][:batch], [256, 256, 20][:batch], [1.0, 1.0, 0.9][:batch], [0.0, 0.0, 0.05][:batch],
                 uniforms) + RunSampling.greedy_arguments(batch)[5:]
    random_cache(runner.kv_cache, torch.Generator().manual_seed(batch))
    one_at_a_time, ids = [], first_ids
    with torch.inference_mode():
        for step in range(steps):
            layout = StepLayout.of([(p + step, p + step + 1) for p in starts], tables, block_size)
            logits, ids = runner.cpu_model.step(ids, [p + step for p in starts], layout)
            if drawn:
                temperature, top_k, top_p, min_p, uniforms = draws[:5]
                tokens = draw_cpu(logits, torch.tensor(temperature).clamp(min=1e-5), torch.tensor(top_k),
                                  torch.tensor(top_p), torch.tensor(min_p), uniforms[step])
                ids = [token if t > 0 else first for token, t, first in zip(tokens.tolist(), temperature, ids)]
            one_at_a_time.append(ids)
        stepped_cache = [t.clone() for t in runner.kv_cache.tensors()]
        random_cache(runner.kv_cache, torch.Generator().manual_seed(batch))
        layout = StepLayout.of([(p, p + steps) for p in starts], tables, block_size)
        decoded, _ = runner.cpu_model.decode(first_ids, starts, layout, steps, draws)
    assert decoded == one_at_a_time
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.tensors(), stepped_cache))


def test_a_run_of_decode_steps_ends_with_the_step_whose_logits_are_not_finite(tiny_llama64_dir):
    """Greedy rows, and sampled ones, which draw their token of that step as the engine's sampler would."""
    runner = engine(tiny_llama64_dir).engine.runner
    layout = StepLayout.of([(0, 4)] * 3, [[1], [2], [3]], runner.block_size)
    uniforms = torch.tensor([[0.3, 0.6, 0.9]] * 4, dtype=torch.float64)
    draws = ([0.8, 0.8, 0.0], [256] * 3, [0.9] * 3, [0.0] * 3, uniforms) + RunSampling.greedy_arguments(3)[5:]
    with torch.inference_mode():
        runner.model.embed_tokens.weight[6] = float("nan")  # the middle row's first token
        logits, first = runner.cpu_model.step([5, 6, 7], [0, 0, 0], StepLayout.of([(0, 1)] * 3, [[1], [2], [3]],
                                                                                    runner.block_size))
        assert runner.cpu_model.decode([5, 6, 7], [0, 0, 0], layout, 4)[0] == [first]
        drawn = draw_cpu(logits[:1], torch.tensor([0.8]), torch.tensor([256]), torch.tensor([0.9]), torch.zeros(1),
                         uniforms[0, :1]).item()
        assert runner.cpu_model.decode([5, 6, 7], [0, 0, 0], layout, 4, draws)[0] == [[drawn, -1, first[2]]]
    assert first[1] == -1 and -1 not in (first[0], first[2])


def test_a_run_of_decode_steps_ends_with_the_step_where_a_row_samples_one_of_its_stop_tokens(tiny_llama64_dir):
    runner = engine(tiny_llama64_dir).engine.runner
    layout = StepLayout.of([(0, 6)] * 2, [[1], [2]], runner.block_size)
    with torch.inference_mode():
        full, _ = runner.cpu_model.decode([5, 9], [0, 0], layout, 6)
        stop = full[3][1]
        ends = next(step for step, tokens in enumerate(full) if tokens[1] == stop)
        assert runner.cpu_model.decode([5, 9], [0, 0], layout, 6, stop_token_ids=[[], [stop]])[0] == full[:ends + 1]
        assert runner.cpu_model.decode([5, 9], [0, 0], layout, 6, stop_token_ids=[[], [-7]])[0] == full


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_runs_of_decode_steps_give_the_outputs_of_single_steps_greedy_sampled_penalised_and_with_logprobs(
        tiny_llama64_dir, kv_cache_dtype, monkeypatch):
    # each engine would time up to how many rows its float16 GEMV takes, and on a busy machine the two can choose
    # apart: then some steps sum their products in another order (a float32 model's logprobs show it)
    monkeypatch.setattr("qrun.cpu_model.GEMV_ROW_LIMITS", ())
    single = engine(tiny_llama64_dir, num_scheduler_steps=1, kv_cache_dtype=kv_cache_dtype)
    runs = engine(tiny_llama64_dir, kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (9,), generator=g)]
    # lengths, stop tokens, stop strings and EOS end sequences inside runs; sampled rows (seeded, so that both
    # engines draw the same) beside greedy ones; logprobs, of the token alone and with alternatives, beside none
    sampled = [dict(temperature=0), dict(temperature=0.9, seed=1), dict(temperature=0.7, top_p=0.8, seed=2),
               dict(temperature=1.2, top_k=12, min_p=0.05, seed=3), dict(temperature=0, repetition_penalty=1.3),
               dict(temperature=0.8, presence_penalty=0.7, frequency_penalty=1.1, repetition_penalty=0.8, seed=4)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=i % 2 == 0, stop_token_ids=[int(m) % 256] if i % 3 == 0
                             else None, stop=["e"] if i % 4 == 1 else None, logprobs=[None, 0, 4][i % 3],
                             **sampled[i % len(sampled)])
              for i, m in enumerate(torch.randint(2, 60, (9,), generator=g))]
    calls = []
    decode = runs.engine.runner.decode
    runs.engine.runner.decode = lambda batch, stops: calls.append(
        (batch.steps, any(seq.params.logprobs is not None for seq in batch.seqs))) or decode(batch, stops)

    def outputs(llm: LLM) -> list[tuple]:  # the batch, then its first request alone
        done = llm.generate(prompts, params, progress=False) + llm.generate(prompts[:1], params[:1], progress=False)
        return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in done]

    expected = outputs(single)
    assert outputs(runs) == expected
    assert "".join(runs.stream(prompts[1], params[1])) == expected[1][1]  # deltas of several tokens
    assert calls and max(calls)[0] > 2  # a lone sequence ran its steps in runs
    assert any(steps > 2 and logprobs for steps, logprobs in calls)
    blocks = runs.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_the_benchmark_counts_each_token_of_a_run_of_decode_steps_once(tiny_llama64_dir):
    llm = engine(tiny_llama64_dir, max_num_batched_tokens=16)
    prompts = [[3 + i] * (5 + 9 * i) for i in range(4)]
    requests = [BenchRequest(str(i), "", 20 + 7 * i) for i in range(4)]
    passes = []
    llm.engine.step_observers.append(lambda stats: passes.append(stats.forward_passes))
    result = run_qrun(llm, requests, prompt_token_ids=prompts)
    assert max(passes) > 1
    assert result["tokens_computed"] == result["tokens_required"] and result["padding_tokens"] == 0
    assert result["max_batch_tokens"] <= 16  # a forward pass's, not a run's


def test_a_token_id_past_the_embeddings_is_refused_by_name(tiny_llama64_dir):
    runner = engine(tiny_llama64_dir).engine.runner
    vocab = runner.model.config.vocab_size
    layout = StepLayout.of([(0, 1)], [[1]], runner.block_size)
    refused = f"token id {vocab} is outside the {vocab} embeddings"
    with torch.inference_mode(), pytest.raises(RuntimeError, match=refused):
        runner.cpu_model.step([vocab], [0], layout)


def test_a_step_layout_that_does_not_fit_its_rows_is_refused_naming_what_must_match(tiny_llama64_dir):
    runner = engine(tiny_llama64_dir).engine.runner
    layout = StepLayout.of([(0, 1)], [[1]], runner.block_size)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="need one value a row"):
        runner.cpu_model.step([5], [0, 1], layout)


def test_heads_without_a_cpp_attention_keep_the_torch_model(tiny_llama_dir):
    assert engine(tiny_llama_dir).engine.runner.cpu_model is None  # heads of 16


@pytest.mark.parametrize("quantized", [False, True])
def test_decode_steps_read_the_stream_count_under_which_timed_steps_ran_fastest(tiny_llama64_dir, calib_file, tmp_path,
                                                                                monkeypatch, quantized):
    """The float16 GEMVs of a dense bfloat16 model, the VNNI matmuls of a quantized one."""
    path, kind = tiny_llama64_dir, gemv_linears
    if quantized:
        if not cpu_quant_matmul.available():
            pytest.skip("the 4-bit C++ matmul needs AVX512-VNNI")
        path, kind = tmp_path / "llama-q", vnni_matmuls
        convert(tiny_llama64_dir, path, bits=4.0, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    builds = []  # (the read streams of the kind's products, the step built with them)
    build = CpuModel.build.__func__

    def recorded(cls, model, kv_cache):
        step = build(cls, model, kv_cache)
        builds.append(({module.read_streams for module in kind(model)}, step))
        return step

    monkeypatch.setattr(CpuModel, "build", classmethod(recorded))
    timed = []

    def second_fastest(sweep, repeats):
        for streams in READ_STREAMS:
            sweep(streams)
            timed.append(streams)
        return READ_STREAMS[1]

    monkeypatch.setattr(cpu_model, "fastest_read_streams", second_fastest)
    runner = engine(path, dtype="bfloat16").engine.runner
    chosen = {READ_STREAMS[1]}
    assert kind(runner.model) and {module.read_streams for module in kind(runner.model)} == chosen
    assert timed == list(READ_STREAMS)
    assert [streams for streams, step in builds if step is runner.cpu_model] == [chosen]


@pytest.mark.parametrize("winner", [8, 6, None])
def test_dense_linears_take_the_float16_gemv_up_to_the_most_rows_at_which_timed_steps_ran_faster(
        tiny_llama64_dir, monkeypatch, winner):
    """The load tries GEMV_ROW_LIMITS, most first, each against oneDNN at that many rows, and keeps the first that
    wins (none: GEMV_ROWS): the torch model and the C++ step take the GEMV up to it alike, oneDNN past it (the
    float16 copies zeroed, so the two paths' logits differ)."""
    tried = []

    def fastest_when_winning(sweep, choices, default, repeats):
        for choice in choices:
            sweep(choice)
        tried.append(choices)
        return winner if winner in choices else default

    monkeypatch.setattr(cpu_model, "fastest_choice", fastest_when_winning)
    llm = engine(tiny_llama64_dir, dtype="bfloat16")
    runner = llm.engine.runner
    limits = GEMV_ROW_LIMITS[:GEMV_ROW_LIMITS.index(winner) + 1] if winner else GEMV_ROW_LIMITS
    assert tried == [(GEMV_ROWS, limit) for limit in limits]
    rows = winner or GEMV_ROWS
    assert {linear.gemv_rows for linear in gemv_linears(runner.model)} == {rows} and runner.gemv_rows == rows
    for linear in gemv_linears(runner.model):
        linear.weight_f16.zero_()
    for batch in sorted({rows, min(rows + 1, 8)}):
        (torch_logits, _), (cpp_logits, _) = decode_step_both_ways(llm, batch)
        with bfloat16_only(runner.model):
            (onednn_logits, _), _ = decode_step_both_ways(llm, batch, half_gemv=False)
        assert torch.equal(cpp_logits, torch_logits)
        assert torch.equal(cpp_logits, onednn_logits) == (batch > rows)


def test_a_model_the_decode_step_does_not_cover_times_its_products_one_call_each(tiny_llama_dir, monkeypatch):
    measured = []
    monkeypatch.setattr(cpu_model, "measure_read_streams", lambda model: measured.append("vnni"))
    monkeypatch.setattr(cpu_model, "measure_gemv_read_streams", lambda model: measured.append("gemv"))
    assert engine(tiny_llama_dir, dtype="bfloat16").engine.runner.cpu_model is None  # heads of 16
    assert measured == ["vnni", "gemv"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_an_engine_on_the_cpu_model_generates_the_torch_models_tokens(tiny_llama64_dir, monkeypatch,
                                                                     kv_cache_dtype):
    """Prefill, chunked prefill and decode steps interleaved over many sequences."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (7,), generator=g)]
    params = [SamplingParams(max_tokens=3 + 4 * i, **GREEDY) for i in range(7)]
    options = dict(dtype="bfloat16", max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    cpp = engine(tiny_llama64_dir, **options)
    got = [out.outputs[0].token_ids for out in cpp.generate(prompts, params, progress=False)]
    monkeypatch.setattr(CpuModel, "build", classmethod(lambda cls, model, kv_cache: None))
    expected = [out.outputs[0].token_ids for out in engine(tiny_llama64_dir, **options).generate(
        prompts, params, progress=False)]
    assert got == expected
