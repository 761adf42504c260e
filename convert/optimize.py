"""Optimizer: one candidate per block so the total bits meet the target bpw, minimising error.

A multiple-choice knapsack solved by dynamic programming over a finely discretised bit budget:
minimise the sum over blocks of the measured KL each block's quantization costs at the logits
(`kl`, see convert/sensitivity.py; to second order these add up), subject to
sum(bits) <= target * weights. Costs are exact storage bits (all tensors counted).
"""

from __future__ import annotations

import numpy as np

from qrun.convert.job import ConvertError

ERROR_CAP = 0.25
RESOLUTION = 100_000  # budget units; per-block rounding loses at most blocks/RESOLUTION of the budget


def bpw_range(blocks: list[dict]) -> tuple[float, float]:
    weights = sum(b["weights"] for b in blocks)
    low = sum(min(r["bits"] for r in b["results"]) for b in blocks) / weights
    high = sum(max(r["bits"] for r in b["results"]) for b in blocks) / weights
    return low, high


def optimize(blocks: list[dict], target_bpw: float) -> tuple[list[str], float]:
    """(chosen candidate name per block, achieved bpw); achieved <= target, never above."""
    weights = sum(b["weights"] for b in blocks)
    low, high = bpw_range(blocks)
    if target_bpw < low - 1e-9:
        raise ConvertError(f"--bits {target_bpw} is below the smallest achievable {low:.3f} bpw "
                           "(every block at its cheapest candidate)")
    limit = min(target_bpw, high) * weights
    # A candidate whose block output is mostly noise (relative error above ERROR_CAP) wrecks
    # the model whatever the weighted sum says; use such candidates only when the budget
    # cannot be met without them.
    capped = [_capped(b) for b in blocks]
    if sum(min(r["bits"] for r in b["results"]) for b in capped) <= limit:
        blocks = capped
    budget = limit
    for _ in range(4):  # costs are floored onto the grid; shrink the grid budget if that overshoots
        picked = _solve(blocks, budget)
        total = _total_bits(blocks, picked)
        if total <= limit:
            return picked, total / weights
        budget -= (total - limit) + len(blocks) * budget / RESOLUTION
    picked = [min(b["results"], key=lambda r: r["bits"])["candidate"] for b in blocks]
    return picked, _total_bits(blocks, picked) / weights


def _capped(block: dict) -> dict:
    keep = [r for r in block["results"] if r["error"] <= ERROR_CAP]
    return {**block, "results": keep} if keep else block


def _total_bits(blocks, picked) -> int:
    return sum(next(r["bits"] for r in b["results"] if r["candidate"] == name) for b, name in zip(blocks, picked))


def _solve(blocks: list[dict], budget_bits: float) -> list[str]:
    unit = budget_bits / RESOLUTION
    inf = np.inf
    dp = np.full(RESOLUTION + 1, inf)
    dp[0] = 0.0
    choices = []
    for b in blocks:
        new = np.full(RESOLUTION + 1, inf)
        arg = np.full(RESOLUTION + 1, -1, dtype=np.int16)
        for c, r in enumerate(b["results"]):
            cost = int(r["bits"] // unit)
            err = r["kl"] if np.isfinite(r["kl"]) else 1e30
            if cost > RESOLUTION:
                continue
            cand = np.full(RESOLUTION + 1, inf)
            cand[cost:] = dp[:RESOLUTION + 1 - cost] + err
            better = cand < new
            new[better] = cand[better]
            arg[better] = c
        dp = new
        choices.append(arg)
    if not np.isfinite(dp).any():
        return [min(b["results"], key=lambda r: r["bits"])["candidate"] for b in blocks]
    pos = int(np.nanargmin(np.where(np.isfinite(dp), dp, np.nan)))
    picked = []
    for b, arg in zip(reversed(blocks), reversed(choices)):
        r = b["results"][int(arg[pos])]
        picked.append(r["candidate"])
        pos -= int(r["bits"] // unit)
    picked.reverse()
    return picked
