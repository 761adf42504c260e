#!/usr/bin/env python
"""Serving benchmark: one workload through qrun and its peers in one run, interleaved.

Every system gets the same requests (greedy, EOS ignored, each request's `max_tokens` exact) and
thread count, the systems taking turns within each repeat (every other repeat in reverse order); the
peers read the same GGUF (transformers dequantizes it, llama.cpp requantizes a copy when asked for
another type). The whole batch is submitted at once: TTFT and end-to-end latency count from that
submission. Then each system decodes one request alone (--single-stream),
and a roofline line relates the bytes a batch-1 decode step reads to the rate the machine reads
that many bytes again and again (its cache's where they fit, else memory's).

    python scripts/bench_serving.py --num-requests 32 --repeats 2 \
        --systems qrun,qrun@out/smol-4.0,llamacpp@f16,llamacpp@q4_0,hf_cb,hf_static
    python scripts/bench_serving.py --num-requests 32 --busy-cores 1 --systems qrun,qrun@out/smol-4.0
    python scripts/bench_serving.py --num-requests 32 --systems qrun:float32,qrun:bfloat16,qrun@out/smol-4.0
    python scripts/bench_serving.py --workload ../shared/data/workloads/shared_prefix.jsonl \
        --num-requests 64 --systems qrun,qrun_noprefix
    python scripts/bench_serving.py --num-requests 8 --max-tokens-cap 16 --systems qrun --profile
    python scripts/bench_serving.py --num-requests 64 --max-tokens-cap 8 --single-stream-depth 2048 \
        --systems qrun,qrun@out/smol-4.0,llamacpp@f16,llamacpp@q4_0   # single streams after a long context
    python scripts/bench_serving.py --num-requests 64 --kv-cache-memory 114e6 --single-stream 0 \
        --systems qrun+bfloat16,qrun+int8,qrun+int4   # a cache for ~25% of these requests' tokens in bfloat16

Systems (SYSTEM or SYSTEM@VARIANT):
  qrun[@MODEL][:DTYPE][+KV] qrun.LLM (default --model), continuous batching, prefix caching on
                 (metrics: qrun.bench.run_qrun); MODEL may be a `qrun convert` output folder; DTYPE
                 the model's dtype (auto, float32, bfloat16, float16; default --dtype), so that
                 qrun:float32 and qrun:bfloat16 run side by side; KV a kv_cache_dtype (auto,
                 float32, bfloat16, float16, int8, int4; default auto), so that one
                 --kv-cache-memory holds each format's own number of tokens
  qrun_noprefix  the same engine with enable_prefix_caching=False
  qrun_eager[@MODEL] the same engine with enforce_eager=True (no compiled decode steps)
  hf_static      transformers `generate`, left padding, batches of --batch-size in arrival order,
                 each batch runs to its longest max_tokens (static batching)
  hf_cb          transformers continuous batching (the manager behind `generate_batch`), explicit
                 cache settings sized like qrun's; requests added one by one so each keeps its own
                 max_new_tokens (generate_batch itself takes one max_new_tokens for all)
  llamacpp[@TYPE] llama.cpp (llama-cpp-python's low-level batch API) on the GGUF as it is, or on a
                 copy requantized to TYPE (f16, bf16, q8_0, q4_0; made once, kept beside the GGUF),
                 parallel sequences. Install: pip install llama-cpp-python==0.3.36 (builds llama.cpp
                 from source: 2-11 minutes on 2 cores); skipped with a message when missing.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from qrun.atomic import atomic_write_text
from qrun.bench import (BenchRequest, aggregate, busy_cores, decode_step_bytes, format_table, latency_summary,
                        load_workload, measure_arithmetic_rate, measure_read_bandwidth, run_qrun, unquiet_warning)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "data" / "workloads" / "mixed_lengths.jsonl"
ALL_SYSTEMS = ["qrun", "qrun_noprefix", "qrun_eager", "hf_static", "hf_cb", "llamacpp"]
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype's choices, and a qrun system's :DTYPE


class SkipSystem(Exception):
    """A peer that cannot run here (package missing); reported, not fatal."""


def gguf_path(model: str) -> Path:
    from qrun.sources import resolve

    source = resolve(model)
    if source.kind != "gguf":
        raise SystemExit(f"--model {model!r} resolves to a {source.kind} folder; the peers need a .gguf file")
    return Path(source.path)


# -- qrun -----------------------------------------------------------------------------------------

class QrunSystem:
    def __init__(self, name: str, args, model: str, prefix_caching: bool, enforce_eager: bool = False,
                 kv_cache_dtype: str = "auto", dtype: str = "auto"):
        from qrun import LLM

        kwargs = dict(dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_batch_tokens, block_size=args.block_size,
                      enable_prefix_caching=prefix_caching, enforce_eager=enforce_eager,
                      kv_cache_dtype=kv_cache_dtype)
        if args.kv_cache_memory is not None:
            kwargs["kv_cache_memory"] = args.kv_cache_memory
        self.name = name
        self.llm = LLM(model, **kwargs)
        self.ids: list[list[int]] | None = None

    def decode_bytes(self, prompt: str, decoded: int) -> int:
        """Bytes of a batch-1 decode step after `prompt` and `decoded` tokens."""
        context = len(self.llm.tokenizer.encode(prompt)) + decoded
        return decode_step_bytes(self.llm.engine.runner.model, context, self.llm.engine.cache_spec)

    def kv_tokens(self) -> int:
        bm = self.llm.engine.block_manager
        return bm.num_blocks * bm.block_size

    def load_choices(self) -> str:
        """What the load measured: the weight streams each kind of one-row product reads (kernels/read_streams.py),
        and up to how many rows dense linears take the float16 GEMV (qrun/cpu_linear.py)."""
        from qrun.cpu_linear import gemv_linears
        from qrun.quant import vnni_matmuls

        runner = self.llm.engine.runner
        kinds = {"VNNI": vnni_matmuls(runner.model), "float16 GEMV": gemv_linears(runner.model)}
        streams = ", ".join(f"{kind} {'/'.join(str(c) for c in sorted({m.read_streams for m in modules}))}"
                            for kind, modules in kinds.items() if modules)
        rows = f"; float16 GEMV up to {runner.gemv_rows} rows" if runner.gemv_rows else ""
        return f"read streams: {streams}{rows}" if streams else ""

    def warm_up(self) -> None:
        """Compile decode steps now, as a long-running engine does after its first 256 of them
        (qrun/compiled_decode.py), so that the timed runs see the steady state."""
        compiled = self.llm.engine.runner.compiled
        if compiled is not None and compiled.layer is None:
            t = time.perf_counter()
            compiled.compile_now()
            print(f"[{self.name}] compiled decode steps in {time.perf_counter() - t:.1f}s", flush=True)

    def run(self, requests: list[BenchRequest]) -> dict:
        if self.ids is None or len(self.ids) != len(requests):
            self.ids = [self.llm.tokenizer.encode(r.prompt) for r in requests]
        return run_qrun(self.llm, requests, system=self.name, prompt_token_ids=self.ids)


# -- transformers ---------------------------------------------------------------------------------

def load_hf(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qrun.loader import resolve_dtype

    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    model.eval()
    return model, tok


def hf_encode(tok, prompt: str) -> list[int]:
    return tok(prompt, add_special_tokens=True)["input_ids"]


class _FirstToken:
    """A generate() streamer that stamps the first new token (the first put() is the prompt)."""

    def __init__(self):
        self.calls, self.time = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.time is None:
            self.time = time.perf_counter()

    def end(self):
        pass


class HFStaticSystem:
    name = "hf_static"

    def __init__(self, model, tok, batch_size: int):
        self.model, self.tok, self.batch_size = model, tok, batch_size
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.ids: list[list[int]] | None = None

    @torch.inference_mode()
    def run(self, requests: list[BenchRequest]) -> dict:
        if self.ids is None or len(self.ids) != len(requests):
            self.ids = [hf_encode(self.tok, r.prompt) for r in requests]
        ttfts, e2es = [], []
        generated = padding = 0
        peak_alloc, live_at_peak = 0, 0
        t0 = time.perf_counter()
        for start in range(0, len(requests), self.batch_size):
            chunk = list(range(start, min(start + self.batch_size, len(requests))))
            prompts = [self.ids[i] for i in chunk]
            max_new = max(requests[i].max_tokens for i in chunk)
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(prompts):  # left padding
                input_ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            streamer = _FirstToken()
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                                      min_new_tokens=max_new, do_sample=False, pad_token_id=self.pad_id,
                                      streamer=streamer)
            done = time.perf_counter()
            if out.shape[1] - width != max_new:
                raise RuntimeError(f"hf_static generated {out.shape[1] - width} tokens, expected {max_new}")
            real = sum(len(p) + requests[i].max_tokens for p, i in zip(prompts, chunk))
            allocated = len(chunk) * (width + max_new)
            padding += allocated - real
            if allocated > peak_alloc:
                peak_alloc, live_at_peak = allocated, real
            # A request's own max_tokens are what it asked for; the rest of its row is waste.
            generated += sum(requests[i].max_tokens for i in chunk)
            ttfts += [streamer.time - t0] * len(chunk)
            e2es += [done - t0] * len(chunk)
        wall = time.perf_counter() - t0
        prompt_tokens = sum(len(p) for p in self.ids)
        return {"system": self.name, "num_requests": len(requests), "generated_tokens": generated,
                "wall_s": wall, "tokens_per_s": generated / wall, **latency_summary(ttfts, e2es),
                "prompt_tokens": prompt_tokens, "padding_tokens": padding, "batch_size": self.batch_size,
                "prefill_fraction": 1.0, "prefix_hit_rate": 0.0,
                "kv_alloc_over_live": peak_alloc / live_at_peak if live_at_peak else math.nan}


class HFContinuousSystem:
    name = "hf_cb"

    def __init__(self, model, tok, *, page_size: int, num_blocks: int, max_batch_tokens: int,
                 max_requests: int):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model, self.tok = model, tok
        self.ids: list[list[int]] | None = None
        # Explicit sizes: the defaults size the cache from (GPU) memory and batches of 8192 tokens,
        # whose attention masks are pathological on CPU.
        self.cb_config = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests, use_cuda_graph=False, use_async_batching=False,
            scheduler_type="fifo", allow_block_sharing=True)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=-1, pad_token_id=pad)
        self.settings = dict(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                             max_requests_per_batch=max_requests)

    @torch.inference_mode()
    def run(self, requests: list[BenchRequest]) -> dict:
        if self.ids is None or len(self.ids) != len(requests):
            self.ids = [hf_encode(self.tok, r.prompt) for r in requests]
        results = {}
        with self.model.continuous_batching_context_manager(
                generation_config=self.gen_config, continuous_batching_config=self.cb_config,
                block=True, timeout=30, warmup=True) as manager:
            t0 = time.perf_counter()
            rids = [manager.add_request(ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                        record_timestamps=True, eos_token_id=-1)
                    for i, (ids, r) in enumerate(zip(self.ids, requests))]
            while len(results) < len(rids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped early")
                    continue
                if result.is_finished():
                    results[result.request_id] = result
            t_end = time.perf_counter()
        outs = [results[rid] for rid in rids]
        bad = [(o.request_id, o.error) for o in outs if o.error is not None]
        if bad:
            raise RuntimeError(f"hf_cb requests failed: {bad[:3]}")
        generated = sum(len(o.generated_tokens) for o in outs)
        expected = sum(r.max_tokens for r in requests)
        if generated != expected:
            raise RuntimeError(f"hf_cb generated {generated} tokens, expected exactly {expected}")
        ttfts = [o.timestamps[0] - t0 for o in outs]
        e2es = [o.timestamps[-1] - t0 for o in outs]
        wall = t_end - t0
        return {"system": self.name, "num_requests": len(outs), "generated_tokens": generated, "wall_s": wall,
                "tokens_per_s": generated / wall, **latency_summary(ttfts, e2es),
                "prompt_tokens": sum(len(p) for p in self.ids), "padding_tokens": None,
                "prefill_fraction": None, "prefix_hit_rate": None, "kv_alloc_over_live": None,
                "cb_settings": self.settings}


# -- llama.cpp --------------------------------------------------------------------------------------

def _first(module, *names):
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"llama_cpp has none of {names}; unsupported llama-cpp-python version")


LLAMACPP_TYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
                  "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def llamacpp_variant(path: Path, kind: str | None) -> Path:
    """The GGUF itself, or a copy requantized to `kind` by llama.cpp (made once, beside it)."""
    if kind is None:
        return path
    if kind not in LLAMACPP_TYPES:
        raise SystemExit(f"llamacpp@{kind}: choose one of {', '.join(LLAMACPP_TYPES)}")
    out = path.with_name(f"{path.stem}.{kind}.gguf")
    if out.is_file():
        return out
    try:
        import ctypes

        import llama_cpp
    except ImportError:
        raise SkipSystem("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMACPP_TYPES[kind])
    params.allow_requantize = True
    tmp = out.with_name(out.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(path).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {path} to {kind}")
    os.replace(tmp, out)
    return out


def gguf_decode_bytes(path: Path, context: int, kv_bytes_per_token: int) -> int:
    """Bytes a llama.cpp batch-1 decode step reads: every tensor but the embedding table (one row),
    which is read whole when it doubles as the output head; plus the context's K/V."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors["token_embd.weight"]
    return total + context * kv_bytes_per_token


# One decode step of a 4-token prompt, with llama.cpp's weight repacking (its default).
_REPACK_PROBE = """
import sys, llama_cpp as lc
lc.llama_backend_init()
model = lc.llama_model_load_from_file(sys.argv[1].encode(), lc.llama_model_default_params())
params = lc.llama_context_default_params()
params.n_ctx, params.n_threads, params.n_threads_batch = 64, 1, 1
ctx = lc.llama_init_from_model(model, params)
batch = lc.llama_batch_init(4, 0, 1)
for i in range(4):
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 1 + i, i, 1, i == 3
    batch.seq_id[i][0] = 0
batch.n_tokens = 4
sys.exit(lc.llama_decode(ctx, batch))
"""


@functools.cache
def llamacpp_repacks(path: Path) -> bool:
    """Whether llama.cpp's weight repacking (its extra buffer types: AMX, AVX2 interleaving) runs
    on `path` here. It is llama.cpp's default, but llama-cpp-python 0.3.36's AMX repack crashed the
    process (SIGSEGV in the first decode) on a Xeon with AMX: probed in a child process, so a crash
    costs the probe, not the benchmark."""
    probe = subprocess.run([sys.executable, "-c", _REPACK_PROBE, str(path)], capture_output=True, timeout=300)
    if probe.returncode != 0:
        print(f"[llamacpp] {path.name}: llama.cpp crashed with weight repacking on this CPU (exit "
              f"{probe.returncode}); running it without (llama.cpp's --no-repack)", file=sys.stderr)
    return probe.returncode == 0


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python's low-level API: one `llama_batch` per step holding a
    decode token for every running sequence plus prompt chunks of newly admitted ones (the same
    token budget and sequence cap as qrun), greedy argmax on the host, a unified KV cache."""

    def __init__(self, name: str, path: Path, *, threads: int, n_ctx: int, n_batch: int, n_seq_max: int):
        self.name, self.path = name, path
        try:
            import llama_cpp
        except ImportError:
            raise SkipSystem("llama-cpp-python is not installed (pip install llama-cpp-python); "
                             "llamacpp skipped") from None
        import numpy as np

        self.lc, self.np = llama_cpp, np
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = llamacpp_repacks(path)
        load = _first(llama_cpp, "llama_model_load_from_file", "llama_load_model_from_file")
        self.model = load(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True  # one pool shared by all sequences, like a paged cache
        if hasattr(cparams, "no_perf"):
            cparams.no_perf = True
        new_context = _first(llama_cpp, "llama_init_from_model", "llama_new_context_with_model")
        self.ctx = new_context(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        if hasattr(llama_cpp, "llama_model_get_vocab") and hasattr(llama_cpp, "llama_vocab_n_tokens"):
            self.vocab = llama_cpp.llama_model_get_vocab(self.model)
            self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        else:
            self.vocab = None
            self.n_vocab = llama_cpp.llama_n_vocab(self.model)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.ids: list[list[int]] | None = None
        n_layer = llama_cpp.llama_model_n_layer(self.model)
        n_embd = llama_cpp.llama_model_n_embd(self.model)
        heads, kv_heads = llama_cpp.llama_model_n_head(self.model), llama_cpp.llama_model_n_head_kv(self.model)
        self.kv_bytes_per_token = 2 * n_layer * kv_heads * (n_embd // heads) * 2  # float16 cache

    def decode_bytes(self, prompt: str, decoded: int) -> int:
        """Bytes of a batch-1 decode step after `prompt` and `decoded` tokens."""
        return gguf_decode_bytes(self.path, len(self._tokenize(prompt)) + decoded, self.kv_bytes_per_token)

    def _tokenize(self, text: str) -> list[int]:
        lc = self.lc
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 16))()
        target = self.vocab if self.vocab is not None else self.model
        n = lc.llama_tokenize(target, data, len(data), buf, len(buf), True, False)
        if n < 0:
            buf = (lc.llama_token * -n)()
            n = lc.llama_tokenize(target, data, len(data), buf, len(buf), True, False)
        return list(buf[:n])

    def _seq_rm(self, seq: int) -> None:
        lc = self.lc
        if hasattr(lc, "llama_get_memory") and hasattr(lc, "llama_memory_seq_rm"):
            lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), seq, -1, -1)
        else:
            _first(lc, "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm")(self.ctx, seq, -1, -1)

    def run(self, requests: list[BenchRequest]) -> dict:
        lc, np = self.lc, self.np
        if self.ids is None or len(self.ids) != len(requests):
            self.ids = [self._tokenize(r.prompt) for r in requests]
        waiting = list(range(len(requests)))
        free_slots = list(range(self.n_seq_max))[::-1]
        # per running request: slot, position (tokens in cache), next prompt index, generated count
        running: dict[int, dict] = {}
        reserved = 0
        first, finish = [math.nan] * len(requests), [math.nan] * len(requests)
        generated = computed = 0
        batch = self.batch
        t0 = time.perf_counter()
        while waiting or running:
            n, rows = 0, []  # rows: (request, batch index) whose logits are sampled this step
            for i, st in running.items():  # decode: one token each
                if st["next"] is not None:
                    self._add(batch, n, st["next"], st["pos"], st["slot"], True)
                    rows.append((i, n))
                    st["pos"] += 1
                    n += 1
            for i, st in running.items():  # continue unfinished prefills
                n = self._prefill(batch, n, i, st, rows)
            while waiting and n < self.n_batch and free_slots:
                i = waiting[0]
                need = len(self.ids[i]) + requests[i].max_tokens
                if reserved + need > self.n_ctx:  # whole-request reservation: llama.cpp has no preemption
                    break
                waiting.pop(0)
                reserved += need
                st = running[i] = {"slot": free_slots.pop(), "pos": 0, "prompt_at": 0, "next": None, "gen": 0}
                n = self._prefill(batch, n, i, st, rows)
            batch.n_tokens = n
            if n == 0:
                raise RuntimeError("llamacpp: nothing schedulable (n_ctx too small for the next request)")
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            computed += n
            now = time.perf_counter()
            for i, index in rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
                st = running[i]
                st["next"] = int(logits.argmax())
                st["gen"] += 1
                generated += 1
                if st["gen"] == 1:
                    first[i] = now - t0
                if st["gen"] >= requests[i].max_tokens:
                    finish[i] = now - t0
                    self._seq_rm(st["slot"])
                    free_slots.append(st["slot"])
                    reserved -= len(self.ids[i]) + requests[i].max_tokens
                    del running[i]
        wall = time.perf_counter() - t0
        prompt_tokens = sum(len(p) for p in self.ids)
        return {"system": self.name, "num_requests": len(requests), "generated_tokens": generated,
                "wall_s": wall, "tokens_per_s": generated / wall, **latency_summary(first, finish),
                "prompt_tokens": prompt_tokens, "tokens_computed": computed,
                "padding_tokens": computed - (prompt_tokens + generated - len(requests)),
                "prefill_fraction": 1.0, "prefix_hit_rate": 0.0, "kv_alloc_over_live": None}

    def _add(self, batch, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[n] = token
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq
        batch.logits[n] = logits

    def _prefill(self, batch, n: int, i: int, st: dict, rows: list) -> int:
        prompt = self.ids[i]
        while st["prompt_at"] < len(prompt) and n < self.n_batch:
            last = st["prompt_at"] == len(prompt) - 1
            self._add(batch, n, prompt[st["prompt_at"]], st["pos"], st["slot"], last)
            if last:
                rows.append((i, n))
            st["prompt_at"] += 1
            st["pos"] += 1
            n += 1
        return n

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        _first(lc, "llama_model_free", "llama_free_model")(self.model)


# -- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="JSONL: id, prompt, max_tokens per line")
    ap.add_argument("--num-requests", type=int, default=64, help="first N requests of the workload")
    ap.add_argument("--max-tokens-cap", type=int, default=None, help="cap every max_tokens (quick runs)")
    ap.add_argument("--systems", default="qrun,hf_static,hf_cb,llamacpp",
                    help=f"comma-separated, from {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--model", default="smollm2-135m", help="qrun model alias or .gguf path")
    ap.add_argument("--dtype", default="auto", choices=MODEL_DTYPES,
                    help="qrun and transformers dtype (auto: what qrun picks on this machine); a qrun system's "
                         ":DTYPE overrides it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and llama.cpp threads")
    ap.add_argument("--batch-size", type=int, default=8, help="hf_static batch size")
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per system, interleaved")
    ap.add_argument("--warmup", type=int, default=4, help="requests in a warm-up run per system (0: none)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="running-sequence cap (qrun, hf_cb, llamacpp)")
    ap.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (qrun, hf_cb, llamacpp)")
    ap.add_argument("--block-size", type=int, default=16, help="qrun KV block size (and hf_cb page size)")
    ap.add_argument("--kv-cache-memory", type=float, default=None,
                    help="qrun kv_cache_memory: bytes (> 1) or a fraction of free memory (default: engine's)")
    ap.add_argument("--single-stream", type=int, default=128,
                    help="then decode one request of this many tokens alone per system (0: skip)")
    ap.add_argument("--single-stream-depth", type=int, default=0,
                    help="the single stream decodes after this many tokens of context, the workload's prompts "
                         "joined (llama-bench's depth; 0: the first request's prompt alone)")
    ap.add_argument("--busy-cores", type=int, default=0,
                    help="keep this many cores busy with spinning processes while measuring")
    ap.add_argument("--json", default=None, help="write every run and the medians here")
    ap.add_argument("--profile", action="store_true", help="profile a few qrun engine steps")
    ap.add_argument("--profile-steps", type=int, default=8)
    args = ap.parse_args(argv)
    if args.single_stream_depth < 0:
        ap.error(f"--single-stream-depth {args.single_stream_depth}: give a number of tokens, 0 or more")
    if args.kv_cache_memory is not None and args.kv_cache_memory > 1:
        args.kv_cache_memory = int(args.kv_cache_memory)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if system_kind(s) not in ALL_SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {ALL_SYSTEMS}")
    return args


def parse_system(spec: str) -> tuple[str, str, str | None, str | None]:
    """(SYSTEM, VARIANT or "", DTYPE or None, KV or None) of SYSTEM[@VARIANT][:DTYPE][+KV]: a suffix counts only
    where it names a dtype, so a model path may hold ':' or '+'."""
    from qrun.config import KV_CACHE_DTYPES

    def suffix(text: str, mark: str, names) -> tuple[str, str | None]:
        head, found, tail = text.rpartition(mark)
        return (head, tail) if found and tail in names else (text, None)

    rest, kv_cache_dtype = suffix(spec, "+", KV_CACHE_DTYPES)
    rest, dtype = suffix(rest, ":", MODEL_DTYPES)
    kind, _, variant = rest.partition("@")
    return kind, variant, dtype, kv_cache_dtype


def system_kind(spec: str) -> str:
    """SYSTEM of SYSTEM[@VARIANT][:DTYPE][+KV]."""
    return parse_system(spec)[0]


def build_system(spec: str, args, path: Path, requests: list[BenchRequest], built: dict):
    """The system named by `spec` (SYSTEM[@VARIANT][:DTYPE][+KV]; see the module doc)."""
    kind, variant, dtype, kv_cache_dtype = parse_system(spec)
    qruns = [s for s in built.values() if isinstance(s, QrunSystem)]
    if kind in ("qrun", "qrun_noprefix", "qrun_eager"):
        return QrunSystem(spec, args, variant or args.model, prefix_caching=(kind != "qrun_noprefix"),
                          enforce_eager=(kind == "qrun_eager"), kv_cache_dtype=kv_cache_dtype or "auto",
                          dtype=dtype or args.dtype)
    if dtype or kv_cache_dtype:
        raise SystemExit(f"{spec!r}: a model dtype (:DTYPE) or KV cache dtype (+KV) applies to qrun systems only; "
                         "--dtype sets the others' model dtype")
    if kind in ("hf_static", "hf_cb"):
        if "_hf" not in built:
            built["_hf"] = load_hf(path, args.dtype)
        model, tok = built["_hf"]
        if kind == "hf_static":
            return HFStaticSystem(model, tok, args.batch_size)
        # Sized like qrun's cache, but no bigger than the workload could use.
        need = sum(len(hf_encode(tok, r.prompt)) + r.max_tokens for r in requests)
        tokens = min(need, qruns[0].kv_tokens()) if qruns else need
        num_blocks = -(-tokens // args.block_size) + args.max_num_seqs
        return HFContinuousSystem(model, tok, page_size=args.block_size, num_blocks=num_blocks,
                                  max_batch_tokens=args.max_batch_tokens, max_requests=args.max_num_seqs)
    if kind == "llamacpp":
        n_ctx = qruns[0].kv_tokens() if qruns else 32768
        return LlamaCppSystem(spec, llamacpp_variant(path, variant or None), threads=args.threads, n_ctx=n_ctx,
                              n_batch=args.max_batch_tokens, n_seq_max=args.max_num_seqs)
    raise SystemExit(f"unknown system {spec!r}; choose from {', '.join(ALL_SYSTEMS)}")


def deep_prompt(requests: list[BenchRequest], tokenizer, tokens: int) -> str:
    """The requests' prompts joined as paragraphs (round again where they run out), cut to `tokens` tokens of
    `tokenizer` (qrun's): a context for the single stream to decode after, as llama-bench's depth. Each system
    encodes the text itself, so a peer's count may differ by a token at the cut."""
    round_of_prompts = "".join(r.prompt + "\n\n" for r in requests)
    if not round_of_prompts.strip():
        raise ValueError("the workload's prompts are empty: no text to make a deep context from")
    round_ids = tokenizer.encode(round_of_prompts, add_special_tokens=False)
    return tokenizer.decode((round_ids * -(-tokens // len(round_ids)))[:tokens])


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio_table(summary: list[dict]) -> str:
    """Each qrun system's speed over every other system's: batched tok/s, and single-stream decode."""
    mine = [r for r in summary if r["system"].startswith("qrun")]
    def ratio(a: float, b: float) -> str:
        return "n/a" if math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"  # nan: the run had no single stream

    rows = [["ratio (batched tok/s | single stream)"] + [r["system"] for r in summary]]
    for q in mine:
        rows.append([q["system"]] + [f"{ratio(q['tokens_per_s'], r['tokens_per_s'])} | "
                                     f"{ratio(q['single_stream_tok_s'], r['single_stream_tok_s'])}" for r in summary])
    return _table(rows)


def repeat_order(order: list[str], repeat: int) -> list[str]:
    """The systems' turns in a repeat: every other repeat in reverse, so a machine that drifts through the run
    favours no place in the order."""
    return order if repeat % 2 == 0 else order[::-1]


def repeat_ratios(runs: dict[str, list[dict]], order: list[str]) -> str:
    """Each system's batched tok/s over the first's, repeat by repeat: within a repeat the systems ran back to back,
    so these show how far the machine moved the ratio between repeats."""
    if len(order) < 2:
        return ""
    base = runs[order[0]]
    return f"batched tok/s per repeat, x {order[0]}'s: " + "; ".join(
        f"{name} " + ", ".join(f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" for a, b in zip(runs[name], base))
        for name in order[1:])


def roofline_table(summary: list[dict], step_bytes: dict[str, int], step_bandwidths: dict[str, list[float]],
                   bandwidths: list[float], arithmetic_rates: list[float]) -> str:
    """Bytes a batch-1 decode step reads (weights + the single stream's mean context) times the measured decode rate,
    as a share of the rate at which the machine reads that many bytes over and over, as decode steps do: the best of
    `step_bandwidths`, one reading after each repeat's single streams (a VM's bandwidth swings within minutes; one
    reading in a slow phase would flatter every system). Where a step's bytes fit the last-level cache they read
    faster than memory (`bandwidths`, past the caches), and only the cache's rate bounds the step. `arithmetic_rates`
    (one reading after each repeat) show whether the cores ran at one speed throughout."""
    rows = [["system", "MB read per step", "GB/s reading them", "roofline tok/s", "single-stream tok/s",
             "% of roofline"]]
    for r in summary:
        name = r["system"]
        if name not in step_bytes:
            continue
        roof = max(step_bandwidths[name]) / step_bytes[name]
        rows.append([name, f"{step_bytes[name] / 1e6:.1f}", f"{max(step_bandwidths[name]) / 1e9:.1f}", f"{roof:.1f}",
                     f"{r['single_stream_tok_s']:.1f}", f"{r['single_stream_tok_s'] / roof:.0%}"])
    readings = ", ".join(f"{b / 1e9:.1f}" for b in bandwidths)
    rates = ", ".join(f"{r / 1e9:.1f}" for r in arithmetic_rates)
    warning = unquiet_warning(bandwidths, arithmetic_rates)
    return (f"read bandwidth past the caches {max(bandwidths) / 1e9:.1f} GB/s, the best of {readings}; arithmetic "
            f"{rates} G multiply-adds/s ({torch.get_num_threads()} threads)\n" + _table(rows)
            + (f"\nWARNING: {warning}" if warning else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    requests = load_workload(args.workload, args.num_requests, args.max_tokens_cap)
    path = gguf_path(args.model)
    print(f"workload {args.workload}: {len(requests)} requests, {sum(r.max_tokens for r in requests)} tokens to "
          f"generate; model {path.name} as {args.dtype}; {args.threads} threads; systems {args.systems}",
          flush=True)

    systems: dict[str, object] = {}
    skipped: dict[str, str] = {}
    for spec in args.systems:
        t = time.perf_counter()
        try:
            systems[spec] = build_system(spec, args, path, requests, systems)
        except SkipSystem as why:
            skipped[spec] = str(why)
            print(f"[{spec}] skipped: {why}", flush=True)
            continue
        choices = systems[spec].load_choices() if isinstance(systems[spec], QrunSystem) else ""
        print(f"[{spec}] loaded in {time.perf_counter() - t:.1f}s" + (f" ({choices})" if choices else ""), flush=True)
    order = [s for s in args.systems if s in systems]

    first_use: dict[str, float] = {}  # TTFT p50 of the warm-up: a fresh system's first requests
    if args.warmup:
        warm = requests[:args.warmup]
        warm = [BenchRequest(r.id, r.prompt, min(r.max_tokens, 8), r.prefix_id) for r in warm]
        for name in order:
            t = time.perf_counter()
            systems[name].ids = None
            first_use[name] = systems[name].run(warm)["ttft_p50_s"]
            systems[name].ids = None
            if hasattr(systems[name], "warm_up"):
                systems[name].warm_up()
            print(f"[{name}] warm-up ({len(warm)} requests) {time.perf_counter() - t:.1f}s, first-use TTFT p50 "
                  f"{first_use[name]:.3f}s", flush=True)

    runs: dict[str, list[dict]] = {name: [] for name in order}
    single: dict[str, list[float]] = {name: [] for name in order}
    prompt = requests[0].prompt
    if args.single_stream and args.single_stream_depth:
        qrun_system = next((systems[name] for name in order if isinstance(systems[name], QrunSystem)), None)
        if qrun_system is None:
            raise SystemExit("--single-stream-depth cuts its context with qrun's tokenizer: name a qrun system")
        prompt = deep_prompt(requests, qrun_system.llm.tokenizer, args.single_stream_depth)
    stream = [BenchRequest("single", prompt, args.single_stream)] if args.single_stream else []
    depth = f" after {args.single_stream_depth} tokens of context" if args.single_stream_depth else ""
    bandwidths: list[float] = []  # one reading past the caches after each repeat's single streams
    arithmetic_rates: list[float] = []  # and one of the cores' arithmetic
    # each system's batch-1 step bytes (`roofline_table`), and a reading of that many after each repeat
    step_bytes = {name: systems[name].decode_bytes(stream[0].prompt, args.single_stream // 2)
                  for name in order if stream and hasattr(systems[name], "decode_bytes")}
    step_bandwidths: dict[str, list[float]] = {name: [] for name in step_bytes}
    with busy_cores(args.busy_cores):
        for rep in range(args.repeats):
            turn = repeat_order(order, rep)
            for name in turn:
                result = systems[name].run(requests)
                result["repeat"] = rep
                runs[name].append(result)
                print(f"[{name}] repeat {rep}: {result['tokens_per_s']:.1f} tok/s, wall {result['wall_s']:.2f}s, "
                      f"TTFT p50 {result['ttft_p50_s']:.2f}s", flush=True)
            for name in turn if stream else ():
                systems[name].ids = None
                one = systems[name].run(stream)
                systems[name].ids = None
                single[name].append((args.single_stream - 1) / (one["e2e_p50_s"] - one["ttft_p50_s"]))
                print(f"[{name}] single stream {args.single_stream} tokens{depth}: {single[name][-1]:.1f} tok/s "
                      "decode", flush=True)
            if stream:
                bandwidths.append(measure_read_bandwidth())
                arithmetic_rates.append(measure_arithmetic_rate())
                for name, size in step_bytes.items():
                    step_bandwidths[name].append(measure_read_bandwidth(size))

    summary = [aggregate(runs[name]) for name in order]
    for row in summary:
        row["single_stream_tok_s"] = statistics.median(single[row["system"]]) if single[row["system"]] else math.nan
    print()
    print(format_table(summary, baseline=order[0] if order else "qrun"))
    base = next((r for r in summary if r["system"].startswith("qrun") and "tokens_computed" in r), None)
    if base:
        print(f"\n{base['system']}: {base['tokens_computed']} tokens computed for {base['tokens_required']} required "
              f"(padding/recompute {base['padding_tokens']}, preemptions {base['preemptions']}); prefill computed "
              f"{base['prefill_tokens_computed']} of {base['prompt_tokens']} prompt tokens "
              f"({base['prefill_fraction']:.1%}); KV peak {base['kv_peak_blocks']} blocks x {base['kv_block_size']} "
              f"for {base['kv_live_tokens_at_peak']} live tokens (alloc/live {base['kv_alloc_over_live']:.3f}, "
              f"alloc/ceil {base['kv_alloc_over_ceil']:.3f}) of {base['kv_blocks_total']} blocks")
    print()
    print(ratio_table(summary))
    ratios = repeat_ratios(runs, order)  # none for one system
    if ratios:
        print(ratios)
    if first_use:
        base_ttft = first_use[order[0]]
        print(f"\nfirst use (the warm-up's {args.warmup} requests on a fresh system), TTFT p50 and x {order[0]}'s: "
              + ", ".join(f"{name} {ttft:.3f}s ({ttft / base_ttft:.2f}x)" for name, ttft in first_use.items()))
    if stream:
        print()
        print(roofline_table(summary, step_bytes, step_bandwidths, bandwidths, arithmetic_rates))
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")

    profile = None
    if args.profile:
        qname = next((s for s in order if system_kind(s) in ("qrun", "qrun_noprefix", "qrun_eager")), None)
        if qname is None:
            print("--profile needs qrun or qrun_noprefix among --systems")
        else:
            from profile_steps import format_profile, profile_qrun

            profile = profile_qrun(systems[qname].llm, requests, steps=args.profile_steps)
            print()
            print(format_profile(profile))

    if args.json:
        payload = {"args": {k: v for k, v in vars(args).items()}, "workload": os.path.abspath(args.workload),
                   "torch_threads": torch.get_num_threads(), "summary": summary, "runs": runs, "single_stream": single,
                   "first_use_ttft_p50_s": first_use, "read_bandwidths": bandwidths,
                   "arithmetic_rates": arithmetic_rates,
                   "step_read_bandwidths": step_bandwidths, "skipped": skipped,
                   "profile": profile}
        atomic_write_text(args.json, json.dumps(payload, indent=2, default=str))
        print(f"\nwrote {args.json}")
    for name in order:
        close = getattr(systems[name], "close", None)
        if close:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
