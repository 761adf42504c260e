"""Keeping native memory bounded: what a load freed, and a long-running engine's heaps and matmul caches.

torch's CPU bfloat16 matmuls run on oneDNN (through ideep), which keeps a compiled kernel for
every input shape it has seen, in two caches of 1,024 entries each by default: a server sees a
new row count with almost every prefill, so they only grow (1,200 new shapes of SmolLM2's linears
after a heap trim: +403 MiB; with both capped at 256 entries, +3 MiB once they are full; on a Xeon
with AMX +465 and +46 MiB, the capped caches levelling off at ~100 MiB as their kernels for more
rows are bigger).
`bound_matmul_caches` caps both at MATMUL_SHAPE_CACHE, which still holds every decode batch
size a step repeats.

glibc's allocator keeps much of what a long-running engine frees (activations of every new
prefill size, scratch of every new matmul shape) in its heaps instead of returning it, so a
server's resident memory climbs long after its working set stopped growing: in a 450-request
soak of SmolLM2 it grew +314, +112, +60 MiB per 150 requests; with `malloc_trim` after each
150, +206 then +11. `HeapTrimmer` trims every TRIM_INTERVAL_S of serving and when the engine
goes idle. A load frees several times what it keeps (tensors read, unpacked, packed into the
kernels' layouts, copied into huge pages), so it trims too (`trim_heap`): SmolLM2 in bfloat16 held
1,109 MB more after its load than before without, 641 with (its tensors ~600 MB), and at 4.0 bpw
480 against 247 (~140). Off glibc nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from typing import Callable

# A trim walks the heap (milliseconds); every half minute it costs well under 0.1% of serving.
TRIM_INTERVAL_S = 30.0
MATMUL_SHAPE_CACHE = 256


def bound_matmul_caches() -> None:
    """Cap oneDNN's and ideep's per-shape caches, unless the user set them. Both read their
    capacity once, at the first matmul: call before any."""
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(MATMUL_SHAPE_CACHE))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> None:
    """Hand the memory glibc's heaps hold free back to the system."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class HeapTrimmer:
    """Trims the heap at most once per `interval_s`, and once whenever the engine goes idle."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._dirty = False  # freed memory since the last trim

    def after_step(self) -> None:
        self._dirty = True
        if time.monotonic() - self._last >= self.interval_s:
            self.trim()

    def on_idle(self) -> None:
        if self._dirty:
            self.trim()

    def trim(self) -> None:
        trim_heap()
        self._last, self._dirty = time.monotonic(), False
