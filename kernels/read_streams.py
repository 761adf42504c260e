"""How many sequential streams of weights each thread reads side by side in a one-row product:
measured on the machine, at load, not assumed.

At one or two rows a product is bound by reading its weights, and how many sequential streams a
core keeps fastest in flight differs by CPU: for the VNNI kernel's 4-bit weights four streams beat
one on a 2-core Xeon (the 6-bit head of a 4.0-bpw SmolLM2 1.64 -> 1.02 ms), while on a 2-core EPYC
(Zen 4) fewer did (single-stream decode 154 / 172 / 177 tok/s at 4 / 2 / 1; on a Zen 3 EPYC with AVX2
alone 0.69x / 0.91x / 1x, the counts alternating in one process: a one-off probe); for the float16 GEMV
of dense models, four beat one on the Xeon (23.5 vs 19.4 GB/s) and two beat four on the EPYC
(single-stream decode 1.06-1.09x). The streams change no result, only the order of the reads.
What is timed is what decode steps run: the C++ step at batch 1 where it covers the model
(`qrun/cpu_model.py`: its products back to back on one held team of threads, which timing them one
call each does not show), else the products one call each (`fastest_for`). `fastest_choice`, the
timing behind both, also picks up to how many rows dense linears take the float16 GEMV
(`qrun/cpu_linear.py`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Sequence, TypeVar

import torch

READ_STREAMS, DEFAULT_READ_STREAMS = (1, 2, 4), 4
Choice = TypeVar("Choice")
BUDGET_BYTES = 512 << 20  # weights timed at most: beyond any cache but the largest


def fastest_choice(sweep: Callable[[Choice], object], choices: Sequence[Choice], default: Choice, repeats: int = 5,
                   margin: float = 0.03) -> Choice:
    """The one of `choices` under which `sweep(choice)` runs fastest against `default`: by the median
    over `repeats` rounds, each timing every choice once (after one untimed run each; every other
    round in reverse order), of its time over the default's in the same round. `default` unless
    another beats it by `margin`.

    Both the ratios and the order matter on a VM whose speed drifts within seconds: on a 2-core Zen 3
    EPYC, whose 1 and 2 read streams run two 4.0-bpw SmolLM2 steps ~6% apart (per-round ratios
    0.93-1.22 from the 5th to the 95th percentile), the slower count was chosen in 8 of 60 trials by
    each count's own median at 5 rounds; by the ratios in one order, in 3 and 8 of 60 at 15 rounds;
    by the ratios in alternating order, in 6 of 60 at 5 rounds and in none of 120 at 15 (one-off
    probes, the trials back to back in one process)."""
    for choice in choices:
        sweep(choice)
    rounds: list[dict[Choice, float]] = []
    for repeat in range(repeats):
        times = {}
        for choice in choices if repeat % 2 == 0 else choices[::-1]:
            start = time.perf_counter()
            sweep(choice)
            times[choice] = time.perf_counter() - start
        rounds.append(times)
    relative = {choice: statistics.median(times[choice] / times[default] for times in rounds) for choice in choices}
    best = min(relative, key=relative.__getitem__)
    return best if relative[best] < 1 - margin else default


def fastest_read_streams(sweep: Callable[[int], object], repeats: int = 5, margin: float = 0.03) -> int:
    """The count of READ_STREAMS under which `sweep(read_streams)` (a model's one-row products, as
    a decode step runs them) is fastest (`fastest_choice`; DEFAULT_READ_STREAMS unless another
    beats it by `margin`)."""
    return fastest_choice(sweep, READ_STREAMS, DEFAULT_READ_STREAMS, repeats, margin)


def fastest_for(products: Iterable[tuple[Callable[[int], object], int]], budget_bytes: int = BUDGET_BYTES) -> int:
    """`fastest_read_streams` over a model's one-row products in model order, as a decode step
    reads them: (multiply(read_streams), bytes of weights it reads) pairs, taken from `products`
    (an iterator: the pairs past the budget are never made) until `budget_bytes` of them (all of a
    small model's); DEFAULT_READ_STREAMS for none."""
    swept, total = [], 0
    for multiply, weight_bytes in products:
        swept.append(multiply)
        total += weight_bytes
        if total >= budget_bytes:
            break
    if not swept:
        return DEFAULT_READ_STREAMS

    def sweep(read_streams: int) -> None:
        for multiply in swept:
            multiply(read_streams)

    with torch.inference_mode():
        return fastest_read_streams(sweep)
