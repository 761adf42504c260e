"""Decode steps on the CPU through one `torch.compile`d decoder layer, where the C++ decoder layer
(`qrun/cpu_model.py`, the faster path) does not cover the model: quantized KV caches, heads
without a C++ attention, 4-bit models on CPUs without AVX2.

In eager mode a decoder layer costs ~50 small torch ops around its matmuls (norms, rotary, casts,
the cache write, the rotations of a mixed-bit model): at one to a few sequences that overhead is
as large as the matmuls. Inductor fuses them into a few loops. One compiled
`DecoderLayer.forward` serves every layer (their weights are its inputs; a mixed-bit model's
layers of different structure get graphs of their own, MAX_GRAPHS) and every batch size and
context length (dynamic shapes): every step where each sequence decodes one token runs it.
Attention in it is the kernel table's C++ decode kernel, one call per layer
(`kernels/cpu_attention.py`, a custom op to Inductor), so the layer compiles only where that
kernel runs.

Compiling the three graphs takes 12-27 s of one core on a 2-core EPYC (less once Inductor's
on-disk cache holds them), the time of several hundred eager decode steps, so an engine starts
compiling only once it has run COMPILE_AFTER_DECODE_STEPS of them, and in a background thread
over a scratch cache: steps keep running eager until the compiled layer is ready, and a one-off
short generation never waits for a compiler. A step the warm-up's graphs do not cover runs the
same layer eagerly instead of compiling in the foreground.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from types import SimpleNamespace
from typing import Callable

import torch
import torch.fx.experimental._config
from torch import nn

from qrun.kernels import backend
from qrun.kv_cache import KVCache
from qrun.model import AttentionMetadata, DecoderLayer, Transformer
from qrun.quant import QuantLinear

log = logging.getLogger("qrun")

COMPILE_AFTER_DECODE_STEPS = 256  # see the module's docstring
# Batch sizes that need graphs of their own: 1 (Dynamo specialises size 1), 2 (dense linears take
# the float16 GEMV path up to cpu_linear.GEMV_ROWS) and 3 and more.
WARM_UP_BATCHES = (1, 2, 3)
# Mixed-bit layers differ in structure (rotated input or not, act-order permutation or not, the
# int4 kernel's group size): Dynamo builds graphs per structure and warm-up batch (a 4.0-bpw
# SmolLM2 from the fast preset has 5 structures, 10 graphs, 20 s to compile). A model with more
# than this many runs the rest of its layers eager.
MAX_GRAPHS = 64
_COMPILE_THREAD = "qrun-compile"
# While FX traces (AOTAutograd's make_fx, Inductor's pattern matcher) it patches nn.Module's __call__ and __getattr__
# for the whole process, so an eager step in the engine's thread during the compile thread's traces called into the
# trace instead of its modules ("NameError: module is not installed as a submodule", failing every request of the
# step). The compile thread traces holding this lock, and steps run holding it while that thread runs.
_TRACING = threading.RLock()


def _trace_holding_lock(trace: Callable) -> Callable:
    @functools.wraps(trace)
    def trace_holding_lock(self, *args, **kwargs):
        if threading.current_thread().name != _COMPILE_THREAD:
            return trace(self, *args, **kwargs)
        with _TRACING:
            return trace(self, *args, **kwargs)

    trace_holding_lock.holds_qrun_lock = True
    return trace_holding_lock


if not getattr(torch.fx.Tracer.trace, "holds_qrun_lock", False):
    torch.fx.Tracer.trace = _trace_holding_lock(torch.fx.Tracer.trace)


def can_compile(model: nn.Module, device: torch.device) -> bool:
    """Whether decode steps can run compiled here: on the CPU (GPUs run the Triton kernels), with
    dense weights or quantized ones on the CPU int4 path, and the C++ kernels built (so a C++
    compiler for Inductor too)."""
    return (device.type == "cpu" and backend(device) == "cpu"
            and all(module.cpu_matmul is not None for module in model.modules() if isinstance(module, QuantLinear)))


def agrees(compiled: torch.Tensor, eager: torch.Tensor) -> bool:
    """Whether the compiled layers' hidden states are eager's, but for rounding: Inductor's code for
    CPUs where torch dispatches AVX2 kernels (torch 2.13; `ATEN_CPU_CAPABILITY=avx2` on an AVX-512
    CPU) computed a tiny Llama's decode steps with logprobs 0.2-0.6 off eager's, where on AVX-512
    its tokens are eager's (tests/test_compiled_decode.py)."""
    error = (compiled.float() - eager.float()).norm() / eager.float().norm().clamp(min=1e-30)
    return bool(error < 1e-2)


class CompiledDecode:
    """The compiled decoder layer of one engine: when to compile it, and when a step may use it."""

    def __init__(self, model: Transformer, kv_cache: KVCache):
        self.model, self.kv_cache, self.block_size = model, kv_cache, kv_cache.block_size
        self.layer: Callable | None = None  # set by the compile thread once every warm-up graph is built
        # What a step the warm-up's graphs do not cover does: run eager, rather than stall the
        # engine on a compile in the foreground (tests make it fail instead).
        self.stance = "eager_on_recompile"
        self.decode_steps = 0
        self._started = False
        self._thread: threading.Thread | None = None

    def layers_for(self, spans: list[tuple[int, int]]) -> Callable | None:
        """`Transformer.forward`'s `layers` running the compiled layer, if a step computing `spans`
        (start, end per sequence) should run it."""
        if any(end - start != 1 for start, end in spans):
            return None
        self.decode_steps += 1
        if not self._started and self.decode_steps > COMPILE_AFTER_DECODE_STEPS:
            self.start()
        return None if self.layer is None else functools.partial(self.model.run_layers, layer_forward=self.layer)

    def start(self) -> threading.Thread:
        """Compile in the background; the thread sets `layer` when done."""
        self._started = True
        self._thread = threading.Thread(target=self._compile, name=_COMPILE_THREAD, daemon=True)
        self._thread.start()
        return self._thread

    def compile_now(self) -> None:
        """Wait for the compiled layer, starting its compile if no step has yet: a benchmark's
        warm-up, so timed runs see the steady state of a long-running engine."""
        if not self._started:
            self.start()
        if self._thread is not None:
            self._thread.join()

    def apart_from_traces(self) -> contextlib.AbstractContextManager:
        """Where a step runs (eager or compiled): while the compile thread runs, not during its traces."""
        compiling = self._thread is not None and self._thread.is_alive()
        return _TRACING if compiling else contextlib.nullcontext()

    def disable(self) -> None:
        """Run eager from now on (the compiled layer failed)."""
        self.layer = None
        self._started = True

    def _compile(self) -> None:
        # rounding where eager mode rounds keeps the compiled step's greedy tokens those of eager
        compiled = torch.compile(DecoderLayer.forward, dynamic=True, options={"emulate_precision_casts": True})
        device = self.model.cos_sin.device
        # A scratch pool shaped like one layer of the real one, so the graphs' guards hold for it:
        # left uninitialised but for the warm-up's two blocks, the only ones touched (SmolLM2 with a
        # 2.2 GiB cache: resident memory grew 46 MiB over the whole compile); zeroed, as its steps
        # attend to them and compare the compiled layers' results with eager's (`agrees`).
        pool = self.kv_cache.layers[0]
        tensors = {name: torch.empty_like(getattr(pool, name)) for name in ("k", "v", "k_scales", "v_scales")
                   if getattr(pool, name) is not None}
        for tensor in tensors.values():
            tensor[:2].zero_()
        scratch = dataclasses.replace(pool, **tensors)
        scratch_cache = SimpleNamespace(layers=[scratch] * len(self.kv_cache.layers))
        try:
            # Without duck shapes, sizes that happen to be equal while tracing (a batch of 3 and 3
            # KV heads) are not assumed equal later: the warm-up's graphs then serve every step.
            # inference_mode as ModelRunner.execute runs: Dynamo builds a graph per grad mode.
            with torch.fx.experimental._config.patch(use_duck_shape=False), torch.inference_mode(), \
                    torch._dynamo.config.patch(recompile_limit=MAX_GRAPHS):
                for batch in WARM_UP_BATCHES:
                    end = self.block_size + 1
                    meta = AttentionMetadata.build([(end - 1, end)] * batch, [[0, 1]] * batch, self.block_size,
                                                   device, compiled=True)
                    ids = torch.arange(batch, dtype=torch.int64, device=device)
                    positions = torch.full((batch,), end - 1, dtype=torch.int64, device=device)
                    eager = self.model(ids, positions, meta, scratch_cache)
                    got = self.model(ids, positions, meta, scratch_cache,
                                     functools.partial(self.model.run_layers, layer_forward=compiled))
                    if not agrees(got, eager):
                        log.warning("compiled decode steps disagree with eager ones on this CPU (torch's %s "
                                    "kernels); they stay eager", torch.backends.cpu.get_cpu_capability())
                        return
        except Exception:  # a machine whose compiler lacks a piece keeps running eager
            log.warning("compiling decode steps failed; they stay eager", exc_info=True)
            return

        def layer(*args):
            with torch.compiler.set_stance(self.stance):
                return compiled(*args)

        self.layer = layer
