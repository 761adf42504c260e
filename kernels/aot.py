"""Ahead-of-time compilation of every Triton launch for real GPUs, on a machine without one.

The launchers plan their launches with pure functions (`*_launches`, see `launch.py`); this
module calls those same functions on meta tensors for the model shapes that matter, compiles
each distinct launch with Triton for the CUDA targets below, and reads what `ptxas -v` reports:
registers, spill bytes, shared memory. A launch fails the check when it does not compile, when
its shared memory exceeds the target's per-block limit, or when it spills.

    python -m qrun.kernels.aot                          # check everything, print the failures
    python -m qrun.kernels.aot --markdown docs/KERNELS.md   # also write the table

Must run without TRITON_INTERPRET=1 (the interpreter replaces the kernels with Python objects
that cannot be compiled); the test suite runs it in a child process. Each compile's result is
cached under the qrun cache (the compiled kernels themselves are not kept), so a second run
takes seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from qrun.atomic import atomic_write_text
from qrun.kernels.launch import MAX_SHARED_MEMORY, Launch


@dataclass(frozen=True)
class Target:
    name: str  # the architecture, as ptxas names it
    capability: int
    cards: str  # what users know it as

    @property
    def shared_memory(self) -> int:
        return MAX_SHARED_MEMORY[self.capability]


TARGETS = [
    Target("sm_75", 75, "T4, RTX 20xx"),
    Target("sm_80", 80, "A100"),
    Target("sm_86", 86, "RTX 30xx, A10"),
    Target("sm_89", 89, "RTX 40xx, L4"),
    Target("sm_90", 90, "H100, H200"),
]


@dataclass(frozen=True)
class ModelShape:
    """The attention and linear shapes of one model family (no weights needed)."""

    name: str
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """(K, N) of each distinct linear, q/k/v and gate/up fused as the engine runs them."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"qkv": (self.hidden, q + 2 * kv), "o": (q, self.hidden),
                "gate_up": (self.hidden, 2 * self.intermediate), "down": (self.intermediate, self.hidden)}


SHAPES = [
    ModelShape("SmolLM2-135M", 576, 1536, 9, 3, 64),
    ModelShape("Qwen2.5-1.5B", 1536, 8960, 12, 2, 128),
    ModelShape("Llama-3-8B", 4096, 14336, 32, 8, 128),
    ModelShape("Mistral-7B", 4096, 14336, 32, 8, 128),
    ModelShape("Phi-2 (head_dim 80)", 2560, 10240, 32, 32, 80),
    ModelShape("Gemma-7B (head_dim 256)", 3072, 24576, 16, 16, 256),
]
DTYPES = [torch.float16, torch.bfloat16]
BLOCK_SIZE = 16  # the engine's KV block size
GROUP_SIZE = 128  # the converter's quantization group


def _meta(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass
class Site:
    """One launch the engine makes, with the variants its launcher may choose between."""

    where: str
    candidates: list[list[Launch]]  # each: the launches of one variant, in the launcher's order of preference
    keep_all: bool = False  # autotuned: every variant that fits may run (else only the first that fits)
    min_capability: int = 0  # targets below it never make this launch (the runtime refuses it there)


def attention_sites(shape: ModelShape, dtype: torch.dtype) -> Iterator[Site]:
    """Decode (one query per sequence) and prefill, with every split count the split-K
    heuristic can choose, each over the launcher's tile candidates; over int8 and int4 caches
    with and without split-K (the split count is no constexpr, only whether there is one)."""
    from qrun.kernels.kv_quant import QUANTIZED_KV_MIN_CAPABILITY, kv_group_size, storage_dtype
    from qrun.kernels.paged_attention import MAX_KV_SPLITS, attention_tile_candidates, paged_attention_launches

    num_seqs, max_seq_len = 4, 4096
    cache_shape = (64, BLOCK_SIZE, shape.num_kv_heads)
    caches = {"": (0, _meta(*cache_shape, shape.head_dim, dtype=dtype), None)}  # name: bits, data, scales
    for bits in (8, 4):
        caches[f", int{bits} cache"] = (
            bits, _meta(*cache_shape, shape.head_dim * bits // 8, dtype=storage_dtype(bits)),
            _meta(*cache_shape, shape.head_dim // kv_group_size(shape.head_dim, bits), 2))
    tables = _meta(num_seqs, max_seq_len // BLOCK_SIZE, dtype=torch.int32)
    seq_lens, starts = _meta(num_seqs, dtype=torch.int32), _meta(num_seqs + 1, dtype=torch.int32)
    for phase, tokens in (("decode", num_seqs), ("prefill", 512)):
        q = _meta(tokens, shape.num_heads, shape.head_dim, dtype=dtype)
        max_query_len = 1 if phase == "decode" else tokens
        for cache_name, (bits, cache, scales) in caches.items():
            splits = 1
            while splits <= (MAX_KV_SPLITS if scales is None else 2):
                yield Site(f"{phase}{cache_name}, {splits} split{'s' * (splits > 1)}", [
                    paged_attention_launches(q, cache, cache, tables, seq_lens, starts, max_query_len, max_seq_len,
                                             shape.head_dim ** -0.5, torch.empty_like(q), scales, scales, sms=1,
                                             tiles=tiles, num_splits=splits)
                    for tiles in attention_tile_candidates(shape.head_dim, shape.num_heads // shape.num_kv_heads,
                                                           max_query_len, bits)],
                    min_capability=0 if scales is None else QUANTIZED_KV_MIN_CAPABILITY)
                splits *= 2


def linear_sites(shape: ModelShape, dtype: torch.dtype) -> Iterator[Site]:
    """Dequant-matmul for each linear: the GEMV path at 1-4 rows, the autotuned tiles at 16 and 64
    rows, and the dequantization that precedes torch's matmul above."""
    from qrun.kernels.dequant_matmul import GEMV_MAX_M, TILED_MAX_M, dequant_matmul_launches

    for name, (k, n) in shape.linears.items():
        groups = k // GROUP_SIZE
        packed = (_meta(groups * GROUP_SIZE * 8 // 32, n, dtype=torch.int32), _meta(groups, 2, dtype=torch.int32),
                  _meta(groups, n, dtype=torch.uint8), _meta(n, dtype=torch.float32))
        perm = _meta(k, dtype=torch.int32)
        for rows in sorted({1, 2, GEMV_MAX_M, 16, TILED_MAX_M, 4096}):
            launches = dequant_matmul_launches(_meta(rows, k, dtype=dtype), *packed, None, None, perm, GROUP_SIZE,
                                               sms=1, every_config=True)
            yield Site(f"{name} {k}x{n}, {rows} rows", [[launch] for launch in launches],
                       keep_all=GEMV_MAX_M < rows <= TILED_MAX_M)


def elementwise_sites(shape: ModelShape, dtype: torch.dtype) -> Iterator[Site]:
    from qrun.kernels.cache_ops import store_kv_launches
    from qrun.kernels.kv_quant import QUANTIZED_KV_MIN_CAPABILITY, kv_group_size, storage_dtype
    from qrun.kernels.norm import rms_norm_launches
    from qrun.kernels.rotary import apply_rotary_launches

    tokens = 256
    x = _meta(tokens, shape.hidden, dtype=dtype)
    for residual in (None, x):
        yield Site("rms_norm" + (" + residual" if residual is not None else ""),
                   [rms_norm_launches(x, _meta(shape.hidden, dtype=dtype), 1e-6, residual)])
    q = _meta(tokens, shape.num_heads, shape.head_dim, dtype=dtype)
    k = _meta(tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype)
    yield Site("rotary", [apply_rotary_launches(q, k, _meta(tokens, dtype=torch.int64),
                                                _meta(4096, shape.head_dim, dtype=torch.float32))])
    cache = _meta(64, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, dtype=dtype)
    slots = _meta(tokens, dtype=torch.int64)
    yield Site("store_kv", [store_kv_launches(k, k, cache, cache, slots)])
    for bits in (8, 4):
        data = _meta(64, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim * bits // 8, dtype=storage_dtype(bits))
        scales = _meta(64, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim // kv_group_size(shape.head_dim, bits), 2)
        yield Site(f"store_kv, int{bits} cache", [store_kv_launches(k, k, data, data, slots, scales, scales)],
                   min_capability=QUANTIZED_KV_MIN_CAPABILITY)


def all_sites() -> Iterator[Site]:
    for shape in SHAPES:
        for dtype in DTYPES:
            label = f"{shape.name}, {str(dtype).removeprefix('torch.')}"
            for make in (attention_sites, linear_sites, elementwise_sites):
                for site in make(shape, dtype):
                    site.where = f"{label}: {site.where}"
                    yield site


@dataclass
class Compiled:
    kernel: str
    target: str
    where: str  # the first model shape and phase that needed this exact compile
    variant: str  # its constexprs and options
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads
    shared_memory: int = 0
    shared_memory_limit: int = 0
    error: str = ""
    chosen: bool = False  # a launcher would run it on this target (it fits, and comes first or is autotuned)

    @property
    def failure(self) -> str:
        if self.error:
            return self.error
        if self.shared_memory > self.shared_memory_limit:
            return f"shared memory {self.shared_memory} B > the target's {self.shared_memory_limit} B per block"
        if self.spill_bytes:
            return f"spills {self.spill_bytes} B of registers"
        return ""


def _compile_spec(launch: Launch, target: Target) -> tuple[Any, dict, dict, dict, dict]:
    """What triton.compile needs for `launch` on `target`: the JITFunction, its signature,
    constexprs, attributes (divisibility specialisation, as the runtime derives it) and options."""
    from triton.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import create_function_from_signature

    fn = launch.jit_function
    backend = make_backend(GPUTarget("cuda", target.capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.constexprs, **launch.options, "debug": False}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return fn, signature, constexprs, attrs, options.__dict__


def _spec_key(target: Target, spec: tuple) -> str:
    fn, signature, constexprs, attrs, options = spec
    return json.dumps([target.name, fn.__name__, signature, sorted(map(str, constexprs.items())),
                       sorted(map(str, attrs.items())), sorted(map(str, options.items()))])


# What a cached result was measured by, so that results measured otherwise are not reused (1: a ptxas run of our
# own, without the flags Triton compiles with; 2: Triton's own run).
RESULTS_VERSION = 2
_PTXAS_LINE = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_one(job: tuple[Target, str, tuple]) -> Compiled:
    """Compile one launch spec for its target and read what Triton's own ptxas run reports
    (`ptxas -v`, with the flags that make the cubin a GPU would load)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, where, ((module, name), signature, constexprs, attrs, options) = job
    fn = getattr(importlib.import_module(module), name)
    variant = ", ".join(f"{fn.arg_names[i[0]]}={v}" for i, v in constexprs.items())
    variant += ", " + ", ".join(f"{k}={options[k]}" for k in ("num_warps", "num_stages"))
    result = Compiled(fn.__name__, target.name, where, variant, shared_memory_limit=target.shared_memory)
    # Triton prints the log of its ptxas run where asked, and runs ptxas only on a miss in its cache: the
    # check's workers compile into an empty cache of their own (_compile_in_workers).
    with knobs.nvidia.scope(), contextlib.redirect_stdout(io.StringIO()) as log:
        knobs.nvidia.dump_ptxas_log = True
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", target.capability, 32), options=options)
        except Exception as e:  # a compile error is the finding, whatever its type
            result.error = f"does not compile: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            return result
    registers, spills = _PTXAS_LINE.search(log.getvalue()), _SPILLS.search(log.getvalue())
    if registers is None:
        result.error = "Triton's ptxas run printed no register count (was the kernel in Triton's cache?)"
        return result
    result.shared_memory = compiled.metadata.shared
    result.registers = int(registers.group(1))
    result.spill_bytes = sum(map(int, spills.groups())) if spills else 0
    return result


def _use_triton_cache(folder: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = folder


def _compile_in_workers(jobs: list[tuple[Target, str, tuple]], workers: int) -> Iterator[Compiled]:
    """compile_one for each job, in order, on `workers` processes compiling into a Triton cache
    of their own, removed after: every compile runs ptxas (so compile_one reads its report), and
    kernels built for GPUs this machine may not have (~0.6 MB each) stay out of the user's cache."""
    with tempfile.TemporaryDirectory(prefix="qrun-aot-triton-") as triton_cache, \
            ProcessPoolExecutor(max(1, min(workers, len(jobs))), initializer=_use_triton_cache,
                                initargs=(triton_cache,)) as pool:
        yield from pool.map(compile_one, jobs, chunksize=2)


def _cached_compile(jobs: dict[str, tuple[Target, str, tuple]], workers: int) -> dict[str, Compiled]:
    """compile_one for every job, reusing results stored under the qrun cache (keyed by the
    spec, the kernel's source hash and Triton's version, so an edited kernel compiles again)."""
    import hashlib

    import triton

    from qrun.sources import cache_dir

    folder = cache_dir() / "aot"
    folder.mkdir(parents=True, exist_ok=True)
    results, todo = {}, {}
    for key, job in jobs.items():
        module, name = job[2][0]
        source_hash = getattr(importlib.import_module(module), name).cache_key
        stamp = f"{key}|{source_hash}|{triton.__version__}|{RESULTS_VERSION}"
        path = folder / (hashlib.sha256(stamp.encode()).hexdigest() + ".json")
        if path.exists():
            stored = json.loads(path.read_text())
            results[key] = Compiled(**{**stored, "where": job[1], "chosen": False})
        else:
            todo[key] = (job, path)
    if not todo:
        return results
    # Stored as each finishes (in order), so an interrupted run keeps its work.
    compiled = _compile_in_workers([job for job, _ in todo.values()], workers)
    for (key, (_, path)), result in zip(todo.items(), compiled):
        results[key] = result
        atomic_write_text(path, json.dumps(asdict(result)))
    return results


@dataclass
class Report:
    compiled: list[Compiled]  # every distinct compile, `chosen` set where a launcher would run it
    failures: list[str]  # sites where no variant fits a target


def check(targets: list[Target] = TARGETS, workers: int | None = None) -> Report:
    """Choose per site and target as the launcher would, compiling what that needs: the first
    variant that fits (variants compiled in rounds, the next only where the previous did not
    fit), or every variant when autotuned. A site fails on a target when none fits."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the ahead-of-time check compiles kernels: run it without TRITON_INTERPRET=1")
    workers = workers or os.cpu_count() or 1
    sites = list(all_sites())
    pending = []  # (target, site, the compile keys of each of its variants)
    jobs: dict[str, tuple[Target, str, tuple]] = {}
    for target in targets:
        for site in sites:
            if target.capability < site.min_capability:
                continue
            variants = []
            for candidate in site.candidates:
                keys = []
                for launch in candidate:
                    spec = _compile_spec(launch, target)
                    key = _spec_key(target, spec)
                    fn = spec[0]  # sent to the workers by name: a JITFunction does not pickle
                    jobs.setdefault(key, (target, site.where, ((fn.fn.__module__, fn.__name__), *spec[1:])))
                    keys.append(key)
                variants.append(keys)
            pending.append((target, site, variants))
    results: dict[str, Compiled] = {}
    tried = [0] * len(pending)  # variants compiled so far, per site
    while True:
        wanted = {}
        for i, (target, site, variants) in enumerate(pending):
            if tried[i] == len(variants):
                continue
            done = [v for v in variants[:tried[i]] if not any(results[k].failure for k in v)]
            if done and not site.keep_all:
                continue
            upto = len(variants) if site.keep_all else tried[i] + 1
            for variant in variants[tried[i]:upto]:
                wanted.update({k: jobs[k] for k in variant if k not in results})
            tried[i] = upto
        if not wanted:
            break
        results.update(_cached_compile(wanted, workers))
    failures = []
    for (target, site, variants), count in zip(pending, tried):
        fitting = [v for v in variants[:count] if not any(results[k].failure for k in v)]
        for variant in fitting if site.keep_all else fitting[:1]:
            for k in variant:
                results[k].chosen = True
        if not fitting:
            smallest = [results[k] for k in variants[-1]]
            failures.append(f"{target.name}, {site.where}: no variant fits; the last: "
                            + "; ".join(f"{r.kernel} {r.failure}" for r in smallest if r.failure))
    return Report(list(results.values()), failures)


def markdown(report: Report) -> str:
    """Per kernel and target: the variants the launchers would run (registers, spills, shared
    memory at most) and how many they passed over because those did not fit."""
    lines = ["# Triton kernels compiled for real GPUs", "",
             "Generated by `python -m qrun.kernels.aot --markdown docs/KERNELS.md`; do not edit by hand.",
             "Every launch the launchers can make for the model shapes in `kernels/aot.py` (SmolLM2,",
             "Qwen2.5-1.5B, Llama-3-8B, Mistral-7B, head_dim 64/80/128/256), fp16 and bf16 with float,",
             "int8 and int4 KV caches, compiled by Triton for each target on a machine without a GPU and",
             "measured with `ptxas -v`. *run*: the variants a launcher would run there (the first that",
             "fits, or all that fit when autotuned);",
             "*passed over*: variants compiled but rejected on that target for spilling registers or",
             "exceeding shared memory.", "",
             "| kernel | target | run | max registers | max spill bytes | max shared memory | limit | passed over |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple[str, str], list[Compiled]] = {}
    for r in report.compiled:
        groups.setdefault((r.kernel, r.target), []).append(r)
    for (kernel, target), rs in sorted(groups.items()):
        run = [r for r in rs if r.chosen] or [Compiled(kernel, target, "", "")]
        lines.append(f"| `{kernel}` | {target} | {sum(r.chosen for r in rs)} | {max(r.registers for r in run)} | "
                     f"{max(r.spill_bytes for r in run)} | {max(r.shared_memory for r in run) / 1024:.1f} KiB | "
                     f"{rs[0].shared_memory_limit / 1024:.0f} KiB | {sum(bool(r.failure) for r in rs)} |")
    cards = ", ".join(f"{t.name} = {t.cards}" for t in TARGETS)
    lines += ["", f"Targets: {cards}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="write the summary table here")
    parser.add_argument("--json", type=Path, help="write every compile's result here")
    parser.add_argument("--targets", default=",".join(t.name for t in TARGETS))
    parser.add_argument("--workers", type=int)
    args = parser.parse_args(argv)
    targets = [t for t in TARGETS if t.name in args.targets.split(",")]
    report = check(targets, args.workers)
    for path, text in ((args.markdown, lambda: markdown(report)),
                       (args.json, lambda: json.dumps({"failures": report.failures, "compiled": [
                           asdict(r) | {"failure": r.failure} for r in report.compiled]}, indent=1))):
        if path:
            atomic_write_text(path, text())
    for failure in report.failures:
        print(f"FAIL {failure}")
    rejected = sum(bool(r.failure) for r in report.compiled)
    print(f"{len(report.compiled)} compiles ({rejected} variants do not fit their target and are passed over), "
          f"{len(report.failures)} launch sites with no variant that fits")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
