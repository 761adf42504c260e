"""Steps on the CPU in one C++ call (`kernels/cpu_model.cpp`): the embedding, every
decoder layer, the final norm and the head.

At one to a few sequences a decode step is bound by per-op overhead, not by the matmuls: eager, a
SmolLM2 layer is ~50 torch ops (~0.7 ms a layer, 22 ms a step at batch 1, against a few ms of
kernel time), and a `torch.compile`d layer was little faster (24 vs 28 ms a step in one run:
Dynamo's guards and the graphs' Python wrappers). The C++ layer runs the eager layer's ops in
its order, with the same kernels (the kernel table's CPU ones, torch's dense matmuls
called from C++), so its results are the torch layers' bit for bit (tested); a 4.0-bpw SmolLM2
step at batch 1 took 9 ms instead of 22. Like exllamav2's C++ attention and MLP, it is built
once at load from the layer's modules (`build_layer`) and holds their weights and cache; the
whole step, embedding to logits, runs from one call (a call from Python costs ~25 us, and so does
each torch op around the layers). It covers float and quantized (int8, int4) KV caches, heads the
C++ attention takes, dense linears and quantized ones on the VNNI kernel; an engine whose layers
or head it does not all cover runs the compiled torch layer instead (`qrun/compiled_decode.py`).
Steps with prefill chunks run here too, beside their decode rows (the attention kernel takes both;
the head multiplies only the rows that sample): a prefill step of 512 tokens called ~2,000 torch
ops from Python, ~13% of its time on a 2-core Xeon (perf), and in a one-off probe there (prefill
steps sent either way, alternating in one process, 2026-12-05) 64 prompts of mixed_lengths.jsonl
prefilled 1.18x (dense bfloat16) and 1.22x (4.0 bpw) faster here than through the torch model,
the whole 64-request run 1.05x and 1.09x.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from qrun.cpu_linear import GEMV_ROW_LIMITS, GEMV_ROWS, CpuDenseLinear, gemv_linears, measure_gemv_read_streams
from qrun.kernels import cpu_library, cpu_quant_matmul
from qrun.kernels.cpu_attention import HEAD_DIMS
from qrun.kernels.cpu_rotation import odd_factor
from qrun.kernels.read_streams import READ_STREAMS, Choice, fastest_choice, fastest_read_streams
from qrun.kv_cache import KVCache, LayerKV
from qrun.model import DecoderLayer, StepLayout, Transformer
from qrun.quant import CpuQuantMatmul, InputRotation, QuantLinear, measure_read_streams, vnni_matmuls
from qrun.sampler import RunSampling

# Linear kinds of cpu_model.cpp
QUANT, DENSE, HALF_GEMV, HALF_GEMV_PACKED, DEQUANTIZED = range(5)
_SLOTS = ("qkv", "o", "gate_up", "down")


def _linear(module: nn.Module, rotation: nn.Module) -> tuple | None:
    """`StepLayer.set_linear`'s arguments after the slot for `module` reading an input rotated
    by `rotation` (an InputRotation or nn.Identity), or None where the C++ layer has no path."""
    if isinstance(module, QuantLinear):
        if module.rotates_input:
            if isinstance(rotation, InputRotation):
                return None
            rotation = module.input_rotation
        module = module.cpu_matmul
    signs, odd = None, None
    if isinstance(rotation, InputRotation):
        signs, odd = rotation.signs, odd_factor(rotation.factors)
    if isinstance(module, CpuQuantMatmul):
        if module.planes is None:  # its fallback: a bfloat16 weight, or torch's int4 kernel (not covered)
            return None if module.dense is None else (DEQUANTIZED, [module.dense], module.bias, module.perm, signs,
                                                      odd, module.out_features, 0, 0, 1, 0, 0, 0, 0, 0)
        planes = module.planes if module.planes[4] is not None else module.planes[:4]
        return (QUANT, list(planes), module.bias, module.perm, signs, odd, module.out_features, module.group,
                module.k_high, module.input_digits, cpu_quant_matmul.tile_rows(),
                cpu_quant_matmul.tile_dequantize_rows(module.group, len(planes) > 4),
                cpu_quant_matmul.dequantize_rows(), module.read_streams, 0)
    if signs is not None:
        return None  # dense linears are never rotated
    if isinstance(module, CpuDenseLinear):
        packed = module.weight_packed is not None
        weights = [module.weight_f16, module.weight_packed if packed else module.weight]
        if module.bias_f16 is not None:
            weights.append(module.bias_f16)
        return (HALF_GEMV_PACKED if packed else HALF_GEMV, weights, module.bias, None, None, None, module.out_features,
                0, 0, 1, 0, 0, 0, module.read_streams, module.gemv_rows)
    if type(module) is nn.Linear:
        return DENSE, [module.weight], module.bias, None, None, None, module.out_features, 0, 0, 1, 0, 0, 0, 0, 0
    return None


def build_layer(layer: DecoderLayer, cache: LayerKV) -> torch.ScriptObject | None:
    """The C++ step of `layer` over `cache`, or None where it does not cover them."""
    attn, mlp = layer.self_attn, layer.mlp
    dtype = layer.input_layernorm.weight.dtype
    cache_tensors = [t for t in (cache.k, cache.v, cache.k_scales, cache.v_scales) if t is not None]
    if (dtype not in (torch.float32, torch.bfloat16) or layer.post_attention_layernorm.weight.dtype != dtype
            or attn.head_dim not in HEAD_DIMS or attn.qkv_proj is None or mlp.gate_up_proj is None
            or not all(t.is_contiguous() for t in cache_tensors)
            or any(t is not None and t.dtype != dtype for t in (cache.k_mean, cache.k_balance, cache.q_balance))):
        return None
    linears = [_linear(attn.qkv_proj, attn.qkv_input), _linear(attn.o_proj, nn.Identity()),
               _linear(mlp.gate_up_proj, mlp.gate_up_input), _linear(mlp.down_proj, nn.Identity())]
    if any(lin is None for lin in linears):
        return None
    fused = torch.classes.qrun.StepLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                         layer.input_layernorm.eps, attn.num_heads, attn.num_kv_heads,
                                         attn.head_dim, attn.scale, cache.k, cache.v, cache.k_scales,
                                         cache.v_scales)
    for slot, args in enumerate(linears):
        fused.set_linear(slot, *args)
    odd = None if cache.rotation_factors is None else odd_factor(cache.rotation_factors)
    fused.set_cache_transforms(cache.rotation_signs, odd, cache.k_mean, cache.k_balance, cache.q_balance,
                               cache.k_reflection)
    return fused


class CpuModel:
    """A model's step in one C++ call: the embedding, every layer, the final norm and the head."""

    def __init__(self, step_model: torch.ScriptObject):
        self.step_model = step_model  # torch.classes.qrun.StepModel

    @classmethod
    def build(cls, model: Transformer, kv_cache: KVCache) -> "CpuModel | None":
        """The C++ model of `model` over `kv_cache`, or None when the library is not built here
        or some layer or the head is not covered (the step then runs the torch layers)."""
        if not cpu_library.available():
            return None
        layers = [build_layer(layer, cache) for layer, cache in zip(model.layers, kv_cache.layers)]
        head = _linear(model.lm_head, nn.Identity())
        embedding = model.embed_tokens.weight
        if (any(fused is None for fused in layers) or head is None or embedding.dim() != 2
                or not embedding.is_contiguous() or embedding.dtype != model.norm.weight.dtype):
            return None
        step_model = torch.classes.qrun.StepModel(model.cos_sin, embedding, model.norm.weight, model.norm.eps)
        for fused in layers:
            step_model.add_layer(fused)
        step_model.set_head(*head)
        return cls(step_model)

    def step(self, ids: list[int], positions: list[int], layout: StepLayout, half_gemv: bool = True,
             sample_rows: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """float32 logits [len(sample_rows), vocab] of a step's rows `sample_rows` (None: every row),
        decode rows and prefill chunks alike (what `Transformer.compute_logits` gives for those rows
        of `Transformer.forward`'s), and each one's first maximum: its greedy token
        (`kernels/argmax.py`), or -1 where a logit is NaN or infinite, found while the logits are in
        the caches (after a 4.0-bpw SmolLM2 step at batch 1 the
        engine's own passes took 164 and 76 us, 10x their warm time: the step's weights have
        streamed through every cache). `half_gemv`: dense
        bfloat16 linears may take their float16 GEMV path (`cpu_linear.bfloat16_only` is the other
        case); a step in which one passes float16's range runs again without it, in the same call."""
        rows = list(range(len(ids))) if sample_rows is None else sample_rows
        return self.step_model.forward(ids, positions, layout.slot_mapping, layout.block_tables,
                                       layout.table_width, layout.seq_lens, layout.query_start_loc, rows, half_gemv)

    def decode(self, ids: list[int], positions: list[int], layout: StepLayout, steps: int,
               sampling: tuple | None = None, stop_token_ids: list[list[int]] | None = None
               ) -> tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Tokens of `steps` decode steps run back to back, each step's tokens the next one's ids: `ids`
        one token of each sequence at `positions`, `layout` covering the positions of every step
        (`StepLayout.of` with spans `(p, p + steps)`). `sampling`: `sampler.RunSampling.arguments`
        (None: every row greedy, without penalties or logprobs); a row's logits take its penalties,
        then its token is their first maximum where its temperature is 0, else drawn as
        `kernels/cpu_draw.py` draws. A list per step, a token per sequence; a step in which a
        sequence's logits are not finite (its token -1) or a sequence's token is one of its
        `stop_token_ids` (None: none) is the last. And the logprobs of the sequences that ask for
        them, a row per step of `kernels/logprobs.py`'s outputs (`RunSampling.logprobs` reads them)."""
        rows = len(ids)
        tokens, *logprobs = self.step_model.decode(
            ids, positions, layout.slot_mapping, layout.block_tables, layout.table_width, steps,
            *(sampling or RunSampling.greedy_arguments(rows)), stop_token_ids or [[] for _ in range(rows)])
        return [tokens[i:i + rows] for i in range(0, len(tokens), rows)], tuple(logprobs)


# Seconds of batch-1 steps a model's load aims to spend choosing each kind of product's read streams, in rounds that
# time each count once, at most TUNING_ROUNDS (SmolLM2 at 4.0 bpw takes 15 rounds of 3 counts x 2 steps, ~0.5 s on a
# 2-core Zen 3 EPYC; dense, whose steps are slower, 3 rounds); a model whose steps are slower times fewer rounds, down
# to one (16 steps in all, the untimed ones included).
TUNING_SECONDS = 0.5
TUNING_ROUNDS = 15
TUNING_STEPS = 2


def fastest_cpu_model(model: Transformer, kv_cache: KVCache) -> CpuModel | None:
    """`CpuModel.build`, with each kind of one-row product (the VNNI kernel's, the float16 GEMV's) reading the count
    of weight streams (`kernels/read_streams.py`) under which a batch-1 step runs fastest on this machine, timed on the
    step itself: there the products run back to back on a held team of threads, which one call at a time does not
    show (on a 2-core EPYC the products timed one call each chose 4 streams for the VNNI kernel, under which 128-token
    4.0-bpw single streams ran 263 tok/s, against 303 with 1 in the same process). Where the step does not cover the
    model, the products are timed one call each, as its torch layers run them. Then the most rows the float16 GEMV
    takes (`cpu_linear.GEMV_ROW_LIMITS`): the largest limit at which steps of that many rows run faster with the GEMV
    than with oneDNN.

    Run before the engine takes requests: the timed steps write their tokens' keys and values to block 0's first slot,
    which holds nothing yet."""
    built = CpuModel.build(model, kv_cache)
    if built is None:
        measure_read_streams(model)
        measure_gemv_read_streams(model)
        return None
    for kind in (vnni_matmuls(model), gemv_linears(model)):
        if not kind:
            continue
        steps: dict[int, CpuModel] = {}
        for streams in READ_STREAMS:
            for module in kind:
                module.read_streams = streams
            steps[streams] = CpuModel.build(model, kv_cache)
        fastest = _timed_choice(steps, 1, fastest_read_streams)
        for module in kind:
            module.read_streams = fastest
        built = steps[fastest]
    linears = gemv_linears(model)
    for limit in GEMV_ROW_LIMITS if linears else ():
        for linear in linears:
            linear.gemv_rows = limit
        steps = {GEMV_ROWS: built, limit: CpuModel.build(model, kv_cache)}
        if _timed_choice(steps, limit, lambda sweep, repeats: fastest_choice(sweep, tuple(steps), GEMV_ROWS,
                                                                             repeats)) == limit:
            return steps[limit]
    for linear in linears:
        linear.gemv_rows = GEMV_ROWS
    return built


def _timed_choice(steps: dict[Choice, CpuModel], rows: int,
                  choose: Callable[[Callable[[Choice], None], int], Choice]) -> Choice:
    """choose(sweep, repeats): sweep(choice) runs TUNING_STEPS steps of `steps[choice]` at `rows` rows (one-token
    sequences), repeats as many as fit TUNING_SECONDS (at least 1, at most TUNING_ROUNDS)."""
    layout = StepLayout(slot_mapping=[0] * rows, block_tables=[0] * rows, table_width=1, seq_lens=[1] * rows,
                        query_start_loc=list(range(rows + 1)))

    def sweep(choice: Choice) -> None:
        for _ in range(TUNING_STEPS):
            steps[choice].step([0] * rows, [0] * rows, layout)

    with torch.inference_mode():
        first = next(iter(steps))
        sweep(first)  # the first steps also fault in the kept buffers
        start = time.perf_counter()
        sweep(first)
        per_sweep = time.perf_counter() - start
        repeats = max(1, min(TUNING_ROUNDS, int(TUNING_SECONDS / (len(steps) * per_sweep)) - 1))
        return choose(sweep, repeats)
