"""Native memory of a long-running engine: heap trims, and the matmul caches bounded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import qrun.heap as heap


def trimmer_counting_trims(monkeypatch, interval_s: float) -> tuple[heap.HeapTrimmer, list[float], list[float]]:
    now = [0.0]
    monkeypatch.setattr(heap.time, "monotonic", lambda: now[0])
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(now[0]))
    return heap.HeapTrimmer(interval_s), trims, now


def test_steps_trim_at_most_once_per_interval(monkeypatch):
    trimmer, trims, now = trimmer_counting_trims(monkeypatch, interval_s=30)
    for second in range(0, 100, 5):
        now[0] = second
        trimmer.after_step()
    assert len(trims) == 3  # at 30, 60 and 90 s


def test_going_idle_trims_once_and_only_after_work(monkeypatch):
    trimmer, trims, now = trimmer_counting_trims(monkeypatch, interval_s=30)
    trimmer.on_idle()
    assert trims == []  # nothing was freed yet
    trimmer.after_step()
    trimmer.on_idle()
    trimmer.on_idle()
    assert len(trims) == 1


def test_the_trim_is_glibcs_where_there_is_one():
    trim = heap._malloc_trim()
    assert trim is None or trim(0) in (0, 1)


def resident_megabytes() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None,
                    reason="reads /proc/self/statm and trims glibc's heap")
def test_memory_freed_between_kept_blocks_goes_back_to_the_system():
    # 64 KiB blocks sit in the heap (below glibc's mmap threshold); a small block kept after each holds the freed
    # ones inside the heap, where free() alone never returns them
    freed, kept = [], []
    for _ in range(1600):
        freed.append(torch.ones(16384))
        kept.append(torch.ones(4))
    held = resident_megabytes()
    freed.clear()
    assert resident_megabytes() > held - 50  # what this test is about: free() kept them
    heap.trim_heap()
    assert resident_megabytes() < held - 75  # of the 100 MiB freed


MANY_SHAPES = r"""
import ctypes, sys, torch
import torch.nn.functional as F
from qrun.heap import bound_matmul_caches
if sys.argv[1] == "capped":
    bound_matmul_caches()
trim = ctypes.CDLL("libc.so.6").malloc_trim
def resident_mib():
    trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
weights = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]]
def linears(rows):  # every prefill of a server has a new row count
    for n in rows:
        for w in weights:
            F.linear(torch.randn(n, w.shape[1], dtype=torch.bfloat16), w)
linears(range(1, 101))  # 400 shapes: the capped caches are full
full = resident_mib()
linears(range(101, 401))  # 1,200 more
print(resident_mib() - full)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm and trims glibc's heap")
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN runs no bfloat16 matmuls on this CPU: nothing fills its caches")
def test_capped_matmul_caches_keep_memory_bounded_over_many_shapes():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}

    def growth_mib(mode: str) -> float:
        run = subprocess.run([sys.executable, "-c", MANY_SHAPES, mode], capture_output=True, text=True, env=env,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        return float(run.stdout.split()[-1])

    # Uncapped, oneDNN's and ideep's caches keep every shape: +403 MiB on an AVX512 EPYC, +465 on a
    # Xeon with AMX. Capped, what is left is the cached kernels' size, which grows with the rows on
    # AMX (+3 MiB on the EPYC, +46 on the Xeon, levelling off at ~100 MiB past 1,000 rows).
    uncapped, capped = growth_mib("uncapped"), growth_mib("capped")
    assert uncapped > 200, f"the shapes no longer fill the caches (+{uncapped:.0f} MiB uncapped)"
    assert capped < uncapped / 5, f"capped caches grew {capped:.0f} MiB over 1,200 new shapes (uncapped {uncapped:.0f})"


def test_bounding_the_caches_leaves_a_users_own_setting(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "32")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    heap.bound_matmul_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "32"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(heap.MATMUL_SHAPE_CACHE)
