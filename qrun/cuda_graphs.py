"""Decode steps on a GPU replayed from CUDA graphs, one per batch-size bucket.

Run eagerly, a decode step of a small model is bound by the host: on an H200 a SmolLM2-135M
step launched ~300 kernels from Python in ~30 ms while the GPU was busy 3% of it
(`scripts/gpu_check.py`'s engine row). A CUDA graph replays a whole step's launches at once.

A graph fixes its kernels' shapes and arguments, so the step's inputs live in static buffers that
every replay reads: a bucket's graph serves every batch of up to that many sequences, its rows
beyond the batch padded, and attention is captured for the longest context a sequence may reach
(it reads each sequence's own length from `seq_lens` at run time). Padding rows repeat the
batch's last row: they write the same K/V to the same slot and attend to the same context, so no
kernel needs a notion of padding, and their outputs are dropped.

A bucket is captured the first time a step needs it (an eager run first, so Triton's compiles and
autotuning happen outside the capture); the graphs share one memory pool, safe because they
never run at once. Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from qrun.kv_cache import KVCache
from qrun.model import AttentionMetadata, StepLayout, Transformer

log = logging.getLogger("qrun")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two up to 8, then steps of 16, and
    `max_num_seqs` itself (a batch pads up to the next one: at most 15 wasted rows)."""
    small = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    return [*small, *range(16, max_num_seqs, 16), max_num_seqs]


class CudaGraphDecode:
    """The decode-step graphs of one engine: its static input buffers, and a graph per bucket."""

    def __init__(self, model: Transformer, kv_cache: KVCache, max_num_seqs: int, max_model_len: int):
        self.model, self.kv_cache, self.block_size = model, kv_cache, kv_cache.block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // self.block_size)
        device = model.cos_sin.device
        rows = self.buckets[-1]
        # token ids, positions, cache slots and context lengths: one host-to-device copy a step
        self.inputs = torch.zeros(4, rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.hidden = torch.empty(rows, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype,
                                  device=device)
        self.replays: dict[int, Callable[[], None]] = {}  # bucket -> its graph's replay
        self.pool = None  # the graphs' shared memory pool, made at the first capture
        self.enabled = True

    def hidden_states(self, input_ids: list[int], positions: list[int], layout: StepLayout) -> torch.Tensor | None:
        """The final hidden states [n, hidden] of a decode step (one new token per sequence), or
        None when no graph covers it (a batch over the largest bucket, a capture that failed)."""
        n = len(input_ids)
        bucket = next((size for size in self.buckets if size >= n), None)
        if not self.enabled or bucket is None or layout.table_width > self.max_blocks:
            return None
        pad = bucket - n
        host = torch.tensor([values + values[-1:] * pad for values in
                             (input_ids, positions, layout.slot_mapping, layout.seq_lens)], dtype=torch.int64)
        self.inputs[:, :bucket].copy_(host)
        width = layout.table_width
        tables = self.block_tables[:bucket, :width]
        tables[:n].copy_(torch.tensor(layout.block_tables, dtype=torch.int32).view(n, width))
        if pad:
            tables[n:] = tables[n - 1]
        replay = self.replays.get(bucket)
        if replay is None:
            try:
                # this very step run eagerly, so that Triton compiles and autotunes outside the
                # capture; the replay below repeats it, writing the same K/V to the same slots
                self._forward(bucket)
                replay = self.replays[bucket] = self._capture(bucket)
            except Exception:  # noqa: BLE001 - an uncapturable step must not stop the engine: eager from now on
                log.warning("capturing a CUDA graph of decode steps failed; they stay eager", exc_info=True)
                self.enabled = False
                return None
        replay()
        return self.hidden[:n]

    def _forward(self, bucket: int) -> None:
        """One decode step of `bucket` rows over the static buffers, into `hidden`."""
        ids, positions, slots, seq_lens = self.inputs[:, :bucket]
        meta = AttentionMetadata(slots, self.block_tables[:bucket], seq_lens.to(torch.int32),
                                 self.query_start_loc[:bucket + 1], max_query_len=1,
                                 max_seq_len=self.max_blocks * self.block_size)
        self.hidden[:bucket].copy_(self.model(ids, positions, meta, self.kv_cache))

    def _capture(self, bucket: int) -> Callable[[], None]:
        """`_forward(bucket)` captured as a CUDA graph; returns its replay."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(bucket)
        return graph.replay
