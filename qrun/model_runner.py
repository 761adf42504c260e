"""Turns a scheduled batch into one flat forward pass and returns the logits to sample from."""

from __future__ import annotations

import contextlib
import logging

import torch

from qrun.compiled_decode import CompiledDecode, can_compile
from qrun.cpu_model import fastest_cpu_model
from qrun.cpu_linear import bfloat16_only, max_gemv_rows
from qrun.cuda_graphs import CudaGraphDecode
from qrun.kernels import backend
from qrun.loader import LoadedModel
from qrun.kv_cache import KVCache, KVCacheSpec, key_calibration
from qrun.model import AttentionMetadata, StepLayout
from qrun.sampler import RunSampling
from qrun.scheduler import ScheduledBatch
from qrun.sequence import Sequence

log = logging.getLogger("qrun")


def _all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every value of the tensors is finite, from their sums: NaN and infinity carry into a
    sum, and finite values sum to infinity only near float32's limit, where a rerun in bfloat16 is
    harmless. One reduction and one host sync for the step (a row of 49,152 float32 logits on a
    2-core Xeon: ~12 us, against ~70 for `isfinite(x).all()`)."""
    return bool(torch.isfinite(sum(t.sum(dtype=torch.float32) for t in tensors if t is not None)))


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, cache: KVCacheSpec,
                 max_num_seqs: int, max_model_len: int, compile_decode: bool = False):
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.config.vocab_size
        self.block_size = block_size
        calibrations = key_calibration(self.model, loaded.tokenizer) if cache.quantized else None
        self.kv_cache = KVCache(loaded.config, num_blocks, block_size, cache, self.device, calibrations)
        # decode steps: the whole model in one C++ call where the CPU kernels cover it, else a
        # compiled torch layer (unless compile_decode is off), else eager; on a GPU with the
        # Triton kernels, CUDA graphs (unless compile_decode is off)
        kernels = backend(self.device)
        self.cpu_model = fastest_cpu_model(self.model, self.kv_cache) if kernels == "cpu" else None
        self.gemv_rows = max_gemv_rows(self.model)  # as fastest_cpu_model left them (0: no float16 GEMV)
        self.compiled = (CompiledDecode(self.model, self.kv_cache) if compile_decode and self.cpu_model is None
                         and can_compile(self.model, self.device) else None)
        self.graphs = (CudaGraphDecode(self.model, self.kv_cache, max_num_seqs, max_model_len)
                       if compile_decode and self.device.type == "cuda" and kernels == "triton" else None)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
        for cache in self.kv_cache.tensors():
            cache[:, dst] = cache[:, src]

    @property
    def decodes_in_steps(self) -> bool:
        """Whether `decode` runs: the C++ model covers this model."""
        return self.cpu_model is not None

    @torch.inference_mode()
    def decode(self, batch: ScheduledBatch, stop_token_ids: list[list[int]]
               ) -> tuple[list[list[int]], list[list[dict[int, float] | None]]]:
        """Run `batch.steps` decode steps of its sequences (one token each) back to back in the C++
        model (`CpuModel.decode`), which picks their tokens as `sample` would (`RunSampling`) and
        ends the run with the step where a sequence samples one of its `stop_token_ids`; the
        tokens and their logprobs (None where a sequence asks for none), a list per step."""
        self.copy_blocks(batch.block_copies)
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        layout = StepLayout.of([(start, start + batch.steps) for start in starts],
                               [seq.block_table for seq in batch.seqs], self.block_size)
        ids = [seq.tokens_between(start, start + 1)[0] for seq, start in zip(batch.seqs, starts)]
        sampling = RunSampling(batch.seqs, batch.steps, self.vocab_size, self.device)
        decoded, logprobs = self.cpu_model.decode(ids, starts, layout, batch.steps, sampling.arguments,
                                                  stop_token_ids)
        sampling.rewind(len(decoded))
        return decoded, sampling.logprobs(decoded, *logprobs)

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence], list[int] | None]:
        """Run the batch; return float32 logits for the sequences that now sample a token, those
        sequences, and each row's first maximum (-1: a logit not finite) where the step found
        them with the logits (the C++ model's), else None.

        A sequence samples when this step computes its last known token; a prefill chunk that
        stops short of the prompt's end only fills the cache.
        """
        with self.compiled.apart_from_traces() if self.compiled is not None else contextlib.nullcontext():
            return self._execute(batch)

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence], list[int] | None]:
        self.copy_blocks(batch.block_copies)
        input_ids: list[int] = []
        spans: list[tuple[int, int]] = []
        sample_rows: list[int] = []
        sampling: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.tokens_between(start, start + n)
            spans.append((start, start + n))
            if start + n == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        one_token_each = all(end - start == 1 for start, end in spans)
        layers = self.compiled.layers_for(spans) if self.compiled is not None else None  # never beside cpu_model
        layout = StepLayout.of(spans, [seq.block_table for seq in batch.seqs], self.block_size,
                               compiled=layers is not None)
        positions = [p for start, end in spans for p in range(start, end)]
        if self.cpu_model is not None:  # decode rows and prefill chunks; logits of the rows that sample
            logits, first_max = self.cpu_model.step(input_ids, positions, layout, sample_rows=sample_rows)
            return logits, sampling, first_max
        if self.graphs is not None and one_token_each:
            hidden = self.graphs.hidden_states(input_ids, positions, layout)
            if hidden is not None:
                rows = hidden if len(sample_rows) == len(input_ids) else hidden[sample_rows]
                return self.model.compute_logits(rows), sampling, None
        meta = AttentionMetadata.of(layout, self.device)
        ids, positions = (torch.tensor(v, dtype=torch.int64, device=self.device) for v in (input_ids, positions))
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)

        def forward(layers) -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = self.model(ids, positions, meta, self.kv_cache, layers)
            return hidden, self.model.compute_logits(hidden[rows]) if sampling else None

        try:
            hidden, logits = forward(layers)
        except Exception:  # a compiled step that fails must not stop the engine: eager from now on
            if self.compiled is None or layers is None:
                raise
            log.warning("compiled decode step failed; running eager from now on", exc_info=True)
            self.compiled.disable()
            layers = None
            hidden, logits = forward(layers)
        if len(input_ids) <= self.gemv_rows and not _all_finite(hidden, logits):
            with bfloat16_only(self.model):  # a value past float16's range (layers or head): rerun in bfloat16
                hidden, logits = forward(layers)
        if logits is None:
            return hidden.new_empty((0, 0), dtype=torch.float32), sampling, None
        return logits, sampling, None
