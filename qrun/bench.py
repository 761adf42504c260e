"""Serving benchmark helpers shared by `scripts/bench_serving.py` and `qrun bench`.

`run_qrun(llm, requests)` submits a whole workload at once (greedy, `ignore_eos`, each request's
`max_tokens` exact) and measures it from the engine's own records:

- throughput: generated tokens / wall time (submission of the batch to the last finish);
- TTFT p50/p90 and end-to-end p50, from submission of the whole batch (RequestOutput.metrics);
- tokens computed: every token the scheduler put in a forward pass (Σ batch.total_tokens). The
  minimum is Σ (prompt − cached + generated − 1) (the last sampled token is never fed back);
  anything above it (padding, recomputation after preemption) is reported as `padding_tokens`;
- prefill tokens computed vs prompt tokens (prefix caching shows up here), prefix hit rate;
- KV blocks at peak: after every step, blocks referenced vs the tokens live in running sequences.

`profile_qrun` runs torch.profiler over a few engine steps and splits the wall time into matmul,
attention, sampling, other torch ops and Python overhead (wall time outside any torch op).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from qrun.atomic import atomic_write_text
from qrun.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qrun.kv_cache import KVCacheSpec
    from qrun.llm_engine import StepStats


@dataclass
class BenchRequest:
    id: str
    prompt: str
    max_tokens: int
    prefix_id: int | None = None


def load_workload(path: str | Path, num_requests: int | None = None,
                  max_tokens_cap: int | None = None) -> list[BenchRequest]:
    """The first `num_requests` lines of a JSONL workload; `max_tokens` optionally capped."""
    requests = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            if num_requests is not None and len(requests) >= num_requests:
                break
            row = json.loads(line)
            max_tokens = int(row["max_tokens"])
            if max_tokens_cap:
                max_tokens = min(max_tokens, max_tokens_cap)
            requests.append(BenchRequest(str(row.get("id", len(requests))), row["prompt"], max_tokens,
                                         row.get("prefix_id")))
    if num_requests is not None and len(requests) < num_requests:
        raise ValueError(f"{path} has only {len(requests)} requests, {num_requests} asked for")
    return requests


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_summary(ttfts: Sequence[float], e2es: Sequence[float]) -> dict[str, float]:
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "e2e_p50_s": percentile(e2es, 50)}


@contextmanager
def _instrument(engine, counters: dict[str, Any]) -> Iterator[None]:
    """Count scheduled tokens and follow KV use through the engine's step observers."""

    def observe(step: "StepStats") -> None:
        counters["steps"] += 1
        counters["tokens_computed"] += step.scheduled_tokens
        counters["max_batch_tokens"] = max(counters["max_batch_tokens"], step.scheduled_tokens // step.forward_passes)
        counters["prefill_computed"] += step.prefill_tokens
        if step.used_blocks > counters["peak_blocks"]:
            counters["peak_blocks"] = step.used_blocks
            counters["live_tokens_at_peak"] = step.live_tokens
            counters["ceil_blocks_at_peak"] = step.partial_blocks
        counters["peak_running"] = max(counters["peak_running"], step.num_running)

    engine.step_observers.append(observe)
    try:
        yield
    finally:
        engine.step_observers.remove(observe)


def run_qrun(llm, requests: Sequence[BenchRequest], *, system: str = "qrun",
             prompt_token_ids: Sequence[list[int]] | None = None, cold_prefix_cache: bool = True) -> dict:
    """Run `requests` through `llm` (a qrun.LLM) as one batch submitted at once; return the metrics."""
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests; run_qrun needs it idle")
    if prompt_token_ids is None:
        prompt_token_ids = [llm.tokenizer.encode(r.prompt) for r in requests]
    if cold_prefix_cache:
        engine.block_manager.reset_prefix_cache()
    block_size = engine.block_manager.block_size
    bm = engine.block_manager
    before = engine.stats()
    queries0, hits0 = bm.prefix_queries, bm.prefix_hits
    counters = dict(steps=0, tokens_computed=0, prefill_computed=0, max_batch_tokens=0, peak_blocks=0,
                    live_tokens_at_peak=0, ceil_blocks_at_peak=0, peak_running=0)
    ids = [f"bench-{system}-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
    finished: dict[str, Any] = {}
    with _instrument(engine, counters):
        t0 = time.time()
        for request_id, ids_, r in zip(ids, prompt_token_ids, requests):
            engine.add_request(request_id, ids_, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                ignore_eos=True), arrival_time=t0)
        try:
            while len(finished) < len(ids):
                for output in engine.step(finished_only=True):
                    finished[output.request_id] = output
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        t_end = time.time()
    after = engine.stats()
    outs = [finished[i] for i in ids]
    generated = sum(len(o.token_ids) for o in outs)
    expected = sum(r.max_tokens for r in requests)
    if generated != expected:
        raise RuntimeError(f"qrun generated {generated} tokens, expected exactly {expected} (ignore_eos)")
    prompt_tokens = sum(o.metrics.num_prompt_tokens for o in outs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    required = prompt_tokens - cached + generated - len(outs)
    ttfts = [o.metrics.first_token_time - t0 for o in outs]
    e2es = [o.metrics.finish_time - t0 for o in outs]
    wall = t_end - t0
    live = counters["live_tokens_at_peak"]
    queries = bm.prefix_queries - queries0
    result = {
        "system": system,
        "num_requests": len(outs),
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        **latency_summary(ttfts, e2es),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "tokens_computed": counters["tokens_computed"],
        "tokens_required": required,
        "padding_tokens": counters["tokens_computed"] - required,
        "prefill_tokens_computed": counters["prefill_computed"],
        "prefill_fraction": counters["prefill_computed"] / prompt_tokens if prompt_tokens else math.nan,
        "prefix_hit_rate": (bm.prefix_hits - hits0) / queries if queries else 0.0,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "steps": counters["steps"],
        "max_batch_tokens": counters["max_batch_tokens"],
        "peak_running": counters["peak_running"],
        "kv_block_size": block_size,
        "kv_blocks_total": after["kv_blocks_total"],
        "kv_tokens": after["kv_blocks_total"] * block_size,  # what the cache holds
        "kv_peak_blocks": counters["peak_blocks"],
        "kv_live_tokens_at_peak": live,
        # allocated slots / live tokens at the peak (1.0 = no waste; < 1 when prefixes are shared)
        "kv_alloc_over_live": counters["peak_blocks"] * block_size / live if live else math.nan,
        # allocated blocks / Σ ceil(live / block_size): waste beyond each sequence's partial last block
        "kv_alloc_over_ceil": (counters["peak_blocks"] / counters["ceil_blocks_at_peak"]
                               if counters["ceil_blocks_at_peak"] else math.nan),
    }
    return result


# -- roofline and background load ------------------------------------------------------------

def decode_step_bytes(model, context: int, cache: "KVCacheSpec") -> int:
    """Bytes a batch-1 decode step of `model` reads: every tensor its forward touches (the
    embedding: one row; a quantized linear: the form it runs, not the packed file tensors),
    plus the K/V of `context` tokens."""
    from qrun.cpu_linear import CpuDenseLinear
    from qrun.quant import CpuQuantMatmul, QuantLinear

    def tensors(module) -> list:
        if isinstance(module, CpuDenseLinear):  # a batch-1 step reads the float16 copy
            return [t for t in (module.weight_f16, module.bias_f16) if t is not None]
        if isinstance(module, CpuQuantMatmul):
            pieces = [module.perm, module.dense, module.bias, *(module.planes or ()), *(module.low or ()),
                      *(module.high or ())]
            return [t for t in pieces if t is not None]
        if isinstance(module, QuantLinear) and module.cpu_matmul is not None:
            return []  # runs through its CpuQuantMatmul child
        return [*module.parameters(recurse=False), *module.buffers(recurse=False)]

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    unique = {id(t): t for module in model.modules() for t in tensors(module)}
    total = sum(nbytes(t) for t in unique.values())
    # Tables read one row a step: the rotary table, and the embedding unless the head reads it
    # whole (tied, and not through a float16 copy of its own).
    tables = [model.cos_sin]
    head = model.lm_head
    if getattr(head, "weight", None) is not model.embed_tokens.weight or isinstance(head, CpuDenseLinear):
        tables.append(model.embed_tokens.weight)
    total -= sum(nbytes(t) - nbytes(t[0]) for t in tables)
    return total + context * cache.bytes_per_token(model.config)


def _fastest_seconds(call, repeats: int) -> float:
    """The least wall time of `repeats` calls of `call`, after one more that warms it (faults pages in, wakes
    threads)."""
    best = math.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure_read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's read bandwidth in bytes/s: the best of `repeats` sums over one buffer of `size_bytes` on torch's
    threads, each thread reading its share in 1, 2, 4 or 8 runs side by side (`kernels/cpu_read.cpp`, as the decode
    kernels read weights; torch's sum, one run per thread, where the C++ kernels are not built: on a 2-core Xeon VM it
    read 273 MB at ~30 GB/s, the probe at ~50). The default is far larger than the caches: memory's rate. A decode
    step's own bytes, read again and again as steps read them, give that step's bound, which is higher where they fit
    the last-level cache (the same Xeon, 300 MB of L3: 95 MB at ~60 GB/s, 1 GB at ~36)."""
    import torch

    from qrun.kernels import cpu_library

    buffer = torch.ones(max(1, size_bytes // 4), dtype=torch.float32)
    reads = ([lambda streams=streams: torch.ops.qrun.read_sum(buffer, streams) for streams in (1, 2, 4, 8)]
             if cpu_library.available() else [buffer.sum])
    return buffer.numel() * 4 / min(_fastest_seconds(read, repeats) for read in reads)


def measure_arithmetic_rate(rounds: int = 1 << 20, repeats: int = 5) -> float:
    """The machine's arithmetic rate in float32 multiply-adds/s on torch's threads: the best of `repeats` runs of
    independent chains of multiply-adds on 16-float vectors (`kernels/cpu_read.cpp`; ~0.01 s each), the FMAs the
    decode kernels run (a 2-core Xeon VM: 5.1-5.7 G 512-bit FMAs a second a core, one-off readings). A VM's host can
    slow its cores apart from its memory (the same Xeon: a decode step's time moved 2.5-4.0 ms within minutes, `top`
    empty, in one-off probes), which the bandwidth readings need not show and which slows compute-bound work
    (attention over a long context, prefill) more than a roofline of bytes allows for. 0 where the C++ kernels are not
    built."""
    import torch

    from qrun.kernels import cpu_library

    if not cpu_library.available():
        return 0.0
    seconds = _fastest_seconds(lambda: torch.ops.qrun.multiply_adds(rounds), repeats)
    return rounds * 12 * 16 * torch.get_num_threads() / seconds


# Readings of one run further apart than this (largest / smallest) mean something outside the VM
# shared the machine meanwhile: its memory bus (seen: 28.6-49.4 GB/s read within one run on an idle
# 2-core EPYC VM, where another run read a steady 32.4-32.6) or its cores (`measure_arithmetic_rate`):
# such a run's timings are not evidence.
QUIET_SPREAD = 1.15


def unquiet_warning(bandwidths: Sequence[float], arithmetic_rates: Sequence[float] = ()) -> str | None:
    """A warning when `bandwidths` (one run's read bandwidth readings, bytes/s) or `arithmetic_rates` (its
    `measure_arithmetic_rate` readings) vary as no quiet machine's do."""
    def swings(readings: Sequence[float]) -> bool:
        return len(readings) >= 2 and max(readings) > QUIET_SPREAD * min(readings)

    moved = []
    if swings(bandwidths):
        moved.append(f"its read bandwidth varied {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s")
    if swings(arithmetic_rates):
        moved.append(f"its arithmetic rate varied {min(arithmetic_rates) / 1e9:.1f}-"
                     f"{max(arithmetic_rates) / 1e9:.1f} G multiply-adds/s")
    if not moved:
        return None
    return (f"the machine was not quiet: {' and '.join(moved)} during the run (a neighbour on the host, as `top` "
            f"cannot show); rerun before taking these ratios or the roofline as evidence")


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes that each keep a core busy while the block runs (a loaded machine)."""
    import multiprocessing

    procs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


# -- reporting --------------------------------------------------------------------------------

TABLE_COLUMNS = [
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90", "{:.2f}"),
    ("e2e_p50_s", "E2E p50", "{:.2f}"),
    ("padding_tokens", "pad tok", "{:d}"),
    ("preemptions", "preempt", "{:d}"),
    ("kv_tokens", "KV tokens", "{:d}"),
    ("kv_alloc_over_live", "KV alloc/live", "{:.3f}"),
    ("prefill_fraction", "prefill/prompt", "{:.1%}"),
    ("prefix_hit_rate", "prefix hit", "{:.1%}"),
]


def aggregate(runs: Sequence[dict]) -> dict:
    """Median over repeats of every numeric metric; other fields from the first run."""
    if len(runs) == 1:
        return dict(runs[0], repeats=1)
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
            med = statistics.median(values)
            out[key] = type(value)(med) if isinstance(value, int) and med == int(med) else med
    out["repeats"] = len(runs)
    out["tokens_per_s_all"] = [r["tokens_per_s"] for r in runs]
    return out


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(results: Sequence[dict], baseline: str = "qrun") -> str:
    """One row per system, plus the ratios to `baseline` (throughput ×, TTFT p50 ×)."""
    base = next((r for r in results if r["system"] == baseline), None)
    header = ["system"] + [title for _, title, _ in TABLE_COLUMNS]
    if base:
        header += [f"{baseline} tok/s ×", f"{baseline} TTFT ÷"]
    rows = [header]
    for r in results:
        row = [r["system"]] + [_cell(r.get(key), fmt) for key, _, fmt in TABLE_COLUMNS]
        if base:
            row.append(_cell(base["tokens_per_s"] / r["tokens_per_s"], "{:.2f}x"))
            row.append(_cell(r["ttft_p50_s"] / base["ttft_p50_s"] if base["ttft_p50_s"] else math.nan, "{:.2f}x"))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- `qrun bench` -----------------------------------------------------------------------------

def add_bench_arguments(parser) -> None:
    from qrun.options import add_engine_arguments

    parser.add_argument("model", help="model folder, .gguf, alias or hub id")
    parser.add_argument("--workload", required=True, metavar="FILE.jsonl",
                        help='requests {"prompt", "max_tokens"} per line, e.g. ../shared/data/workloads/mixed_lengths.jsonl')
    parser.add_argument("--num-requests", type=int, default=None, help="use the first N requests (default: all)")
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="cap each request's max_tokens")
    parser.add_argument("--repeats", type=int, default=1, help="runs to take the median over")
    parser.add_argument("--json", metavar="FILE", help="also write the metrics as JSON")
    add_engine_arguments(parser)
    parser.epilog = ("example:\n  qrun bench smollm2-135m --workload ../shared/data/workloads/mixed_lengths.jsonl "
                     "--num-requests 64\n\nEvery request is greedy with max_tokens exact (EOS ignored), all "
                     "submitted at once.\nscripts/bench_serving.py runs the same measurement beside peers.")


def run_bench(args) -> None:
    from qrun.options import engine_args_from
    from qrun.llm import LLM

    requests = load_workload(args.workload, args.num_requests, args.max_tokens_cap)
    llm = LLM(args.model, **engine_args_from(args))
    ids = [llm.tokenizer.encode(r.prompt) for r in requests]
    result = aggregate([run_qrun(llm, requests, prompt_token_ids=ids) for _ in range(max(1, args.repeats))])
    print(format_table([result]))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2))
