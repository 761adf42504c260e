"""GPTQ (act-order, lazy block updates, mixed bits per input group) and round-to-nearest.

Both quantize one weight matrix W [N out, K in] under a `Candidate` (group size, symmetric or
not, a list of (bits, fraction of groups)). GPTQ needs the Hessian H = sum x x^T of the layer's
inputs over the calibration tokens; `HessianAccumulator` builds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from qrun.errors import QrunError
from qrun.format import BIT_WIDTHS, MatrixLayout, dequantize_groups, pack_matrix
from qrun.kernels.dequant_matmul import MIN_LEVELS, SCALE_LEVELS
from qrun.kernels.rotation import pack_signs, random_signs, rotate, unrotate


class QuantizationError(QrunError):
    """GPTQ cannot quantize this matrix (a shape the format cannot hold, a degenerate Hessian)."""


@dataclass(frozen=True)
class Candidate:
    """One way to quantize a matrix: groups of `group_size` inputs, widths by fraction of groups.

    `bits` lists (width, fraction) with widths descending; with act-order the most important
    input groups (largest Hessian diagonal) come first and get the widest codes. `rotate`
    quantizes in a randomly rotated input basis (kernels/rotation.py): outlier inputs are spread
    over all inputs, which helps wide groups and low widths and flattens importance (so rotated
    candidates are uniform in width and usually without act-order).
    """

    group_size: int
    bits: tuple[tuple[int, float], ...]
    asym: bool = False
    act_order: bool | str = True  # True: columns by importance; "group": whole groups by importance; False: none
    rotate: bool = False

    def __post_init__(self) -> None:
        widths = [b for b, _ in self.bits]
        if any(b not in BIT_WIDTHS for b in widths):
            raise ValueError(f"candidate widths {widths} outside {BIT_WIDTHS}")
        if widths != sorted(widths, reverse=True):
            raise ValueError(f"candidate widths {widths} must be descending")
        if abs(sum(f for _, f in self.bits) - 1.0) > 1e-6:
            raise ValueError(f"candidate fractions {self.bits} do not sum to 1")

    @property
    def name(self) -> str:
        mix = "+".join(f"{b}b{f:g}" if f < 1 else f"{b}b" for b, f in self.bits)
        order = {True: "", False: ":noact", "group": ":gact"}[self.act_order]
        return f"{mix}:g{self.group_size}{':asym' if self.asym else ''}{order}{':rot' if self.rotate else ''}"

    def to_json(self) -> dict:
        return {"name": self.name, "group_size": self.group_size, "asym": self.asym,
                "act_order": self.act_order, "rotate": self.rotate, "bits": [[b, f] for b, f in self.bits]}

    @classmethod
    def from_json(cls, d: dict) -> "Candidate":
        return cls(int(d["group_size"]), tuple((int(b), float(f)) for b, f in d["bits"]),
                   bool(d["asym"]), d.get("act_order", True), bool(d.get("rotate", False)))

    def group_size_for(self, k: int) -> int:
        """The candidate's group size, snapped down to the largest multiple of 32 that divides K
        (K = 576: 128 -> 96, 256 -> 192)."""
        if k % 32:
            raise QuantizationError(f"input size {k} is not a multiple of 32; this format cannot quantize it")
        return next(g for g in range(self.group_size - self.group_size % 32, 0, -32) if k % g == 0)

    def layout(self, k: int, n: int) -> MatrixLayout:
        g = self.group_size_for(k)
        groups = k // g
        widths: list[int] = []
        cumulative = 0.0
        for b, f in self.bits:
            cumulative += f
            count = round(cumulative * groups) - len(widths)
            widths.extend([b] * max(count, 0))
        widths = widths[:groups] + [self.bits[-1][0]] * (groups - len(widths))
        return MatrixLayout(k, n, g, tuple(widths), self.asym, permuted=self.act_order is not False,
                            rotated=self.rotate)


@dataclass
class CodeGrid:
    """The 8-bit grids a matrix's group scales and mins live on: one float16 range per output
    column (docs/FORMAT.md), so each group parameter costs 8 bits instead of 16."""

    scale_max: torch.Tensor  # [N] float16
    min_absmax: torch.Tensor | None  # [N] float16, asymmetric only

    @classmethod
    def covering(cls, scales: torch.Tensor, mins: torch.Tensor | None) -> "CodeGrid":
        """The finest grid that holds the given group scales and mins [G, N]."""
        return cls(_column_range(scales), None if mins is None else _column_range(mins))

    @property
    def steps(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 value of one scale code and one min code per column (as the kernels compute it)."""
        mstep = None if self.min_absmax is None else self.min_absmax.float() / MIN_LEVELS
        return self.scale_max.float() / SCALE_LEVELS, mstep

    def columns(self, cols: slice) -> "CodeGrid":
        return CodeGrid(self.scale_max[cols].contiguous(),
                        None if self.min_absmax is None else self.min_absmax[cols].contiguous())


def _column_range(values: torch.Tensor) -> torch.Tensor:
    return values.abs().amax(0).clamp(min=torch.finfo(torch.float16).tiny).half()


def _snap(values: torch.Tensor, step: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Values on the code grid of `step` (per row), codes clamped to [lo, hi]."""
    return (values / step).round_().clamp_(lo, hi).mul_(step)


@dataclass
class QuantizedMatrix:
    layout: MatrixLayout
    q: torch.Tensor  # [K, N] unsigned ints, permuted order
    scales: torch.Tensor  # [G, N] float32, on grid's scale codes
    mins: torch.Tensor | None  # [G, N] float32, on grid's min codes
    perm: torch.Tensor  # [K] long
    grid: CodeGrid
    signs: torch.Tensor | None = None  # [K] +-1: the input rotation (rotated layouts only)
    extra: dict = field(default_factory=dict)

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K] in original input order (and basis)."""
        w = dequantize_groups(self.q, torch.tensor(self.layout.group_bits), self.layout.group_size,
                              self.scales, self.mins)
        out = torch.empty(self.layout.out_features, self.layout.in_features)
        out[:, self.perm] = w.T
        return out if self.signs is None else unrotate(out, self.signs)

    def columns(self, cols: slice, layout: MatrixLayout) -> "QuantizedMatrix":
        """The result for a range of output columns (a matrix quantized together with others)."""
        return QuantizedMatrix(layout, self.q[:, cols].contiguous(), self.scales[:, cols].contiguous(),
                               None if self.mins is None else self.mins[:, cols].contiguous(), self.perm,
                               self.grid.columns(cols), self.signs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The packed tensors as written to disk (docs/FORMAT.md)."""
        sstep, mstep = self.grid.steps
        out = {
            "qweight": pack_matrix(self.q, self.layout),
            "qgroups": self.layout.qgroups(),
            "scales": (self.scales / sstep).round().to(torch.uint8),
            "scale_max": self.grid.scale_max,
        }
        if self.layout.permuted:
            out["perm"] = self.perm.to(self.layout.perm_dtype)
        if self.signs is not None:
            out["rotation"] = pack_signs(self.signs)
        if self.mins is not None:
            out["mins"] = (self.mins / mstep).round().to(torch.int8)
            out["min_absmax"] = self.grid.min_absmax
        return out


CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8)
INNER = 32  # GPTQ columns between matrix-matrix updates inside a lazy block


def _levels(bits, like: torch.Tensor):
    """(maxq, half) as floats or per-row tensors for an int or a tensor of widths."""
    if isinstance(bits, torch.Tensor):
        b = bits.to(like.dtype)
        return b.exp2() - 1, b.exp2() / 2
    return float((1 << bits) - 1), float(1 << (bits - 1))


def group_params(w: torch.Tensor, bits, asym: bool, clip_search: bool, weight: torch.Tensor | None = None,
                 steps: tuple[torch.Tensor, torch.Tensor | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and min) per row of w [N, G] (float32), optionally searching a clipping ratio.

    `bits` is an int or a tensor [N] of per-row widths. `weight` [G] weighs each column's
    squared error in the clip search (e.g. the Hessian diagonal). `steps` (CodeGrid.steps, per
    row) puts scale and min on their 8-bit grids before they are judged and returned.
    """
    maxq, half = _levels(bits, w)
    xmin = w.min(1).values if asym else w.min(1).values.clamp(max=0)
    xmax = w.max(1).values if asym else w.max(1).values.clamp(min=0)
    ratios = CLIP_GRID if clip_search else (1.0,)
    best_err = best_s = best_m = None
    for p in ratios:
        if asym:
            lo, hi = xmin * p, xmax * p
            s, m = ((hi - lo) / maxq).clamp(min=1e-8), lo
        else:
            s, m = (torch.maximum(-xmin / half, xmax / (half - 1)) * p).clamp(min=1e-8), None
        if steps is not None:
            s = _snap(s, steps[0], 1, SCALE_LEVELS)
            m = None if m is None else _snap(m, steps[1], -MIN_LEVELS, MIN_LEVELS)
        if len(ratios) == 1:
            return s, m
        sf = s[:, None]
        if asym:
            mf = m[:, None]
            deq = (w - mf).div_(sf).round_().clamp_(min=torch.zeros_like(sf), max=_col(maxq)).mul_(sf).add_(mf)
        else:
            deq = (w / sf).round_().clamp_(min=-_col(half), max=_col(half) - 1).mul_(sf)
        err = deq.sub_(w).square_()
        err = err @ weight if weight is not None else err.sum(1)
        if best_err is None:
            best_err, best_s, best_m = err, s.clone(), (m.clone() if m is not None else None)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s, best_s)
            if m is not None:
                best_m = torch.where(better, m, best_m)
    return best_s, best_m


def _col(v):
    return v[:, None] if isinstance(v, torch.Tensor) else torch.tensor(v)


def rtn_quantize(w: torch.Tensor, cand: Candidate, clip_search: bool = False) -> QuantizedMatrix:
    """Round-to-nearest in original input order (no act-order, no error feedback)."""
    w = w.float()
    n, k = w.shape
    layout = Candidate(cand.group_size, cand.bits, cand.asym, act_order=False).layout(k, n)
    g = layout.group_size
    grid = code_grid(w.T, list(layout.group_bits), g, cand.asym)
    steps = grid.steps
    q = torch.empty(k, n, dtype=torch.int64)
    scales = torch.empty(layout.num_groups, n)
    mins = torch.empty(layout.num_groups, n) if cand.asym else None
    for gi, bits in enumerate(layout.group_bits):
        cols = w[:, gi * g:(gi + 1) * g]
        s, m = group_params(cols, bits, cand.asym, clip_search, steps=steps)
        scales[gi] = s
        if mins is not None:
            mins[gi] = m
        maxq = (1 << bits) - 1
        if m is not None:
            qq = ((cols - m[:, None]) / s[:, None]).round().clamp(0, maxq)
        else:
            half = 1 << (bits - 1)
            qq = (cols / s[:, None]).round().clamp(-half, half - 1) + half
        q[gi * g:(gi + 1) * g] = qq.T.long()
    return QuantizedMatrix(layout, q, scales, mins, torch.arange(k), grid)


def code_grid(rows: torch.Tensor, group_bits: list, g: int, asym: bool) -> CodeGrid:
    """The grid covering round-to-nearest group parameters of `rows` [K, C] (inputs as rows,
    groups of g; group_bits: a width, or a tensor [C] of widths, per group).

    GPTQ fixes the grid from the unquantized weights although its error feedback moves them
    afterwards: a group that outgrows its column's range clips at the top code. Measured on
    SmolLM2 matrices, widening the grid to avoid that (10%, 25%) only loses resolution."""
    params = [group_params(rows[gi * g:(gi + 1) * g].T, bits, asym, clip_search=False)
              for gi, bits in enumerate(group_bits)]
    return CodeGrid.covering(torch.stack([s for s, _ in params]),
                             torch.stack([m for _, m in params]) if asym else None)


class HessianAccumulator:
    """H = sum over calibration tokens of x x^T (float32), for one linear input."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k, dtype=torch.float32)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if not self.tokens:
            raise QuantizationError("no calibration tokens reached this layer")
        return self.h / self.tokens


def drift_corrected(w: torch.Tensor, h: torch.Tensor, cross: torch.Tensor, damp: float) -> torch.Tensor:
    """The weights W* whose outputs on the quantized model's inputs X_q best match the original
    model's outputs on its own inputs X_fp: argmin ||W X_fp - W* X_q|| = W + W D H^-1, with
    h = X_q X_q^T / T and cross = D = (X_fp - X_q) X_q^T / T ([K, K]; H damped as GPTQ damps it).
    Since ||W X_fp - V X_q||^2 = ||(W* - V) X_q||^2 + const, GPTQ of W* on h makes each layer
    undo the drift the quantized layers before it caused instead of reproducing it. Where
    nothing has drifted (D = 0) W* is exactly W."""
    chol = torch.linalg.cholesky(_damped(h, damp))
    return w + torch.cholesky_solve(cross.T @ w.T, chol).T


def _damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    """H + damp * mean(diag H) * I: GPTQ's damping, relative to the Hessian's scale."""
    return h + torch.eye(h.shape[0], dtype=h.dtype) * damp * torch.diag(h).mean()


def drift_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, cross: torch.Tensor) -> float:
    """||W X_fp - Ŵ X_q||^2 / T up to a term that does not depend on Ŵ (h, cross as in
    drift_corrected): tr(Ŵ H Ŵ^T) - 2 tr(W (D + H) Ŵ^T)."""
    w, w_hat = w.float(), w_hat.float()
    return float(((w_hat @ h - 2 * w @ (cross + h)) * w_hat).sum())


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, cand: Candidate, damp: float = 0.01,
                  block_size: int = 128, clip_search: bool = True) -> QuantizedMatrix:
    """GPTQ of w [N, K] given the input Hessian h [K, K] (see gptq_quantize_many)."""
    return gptq_quantize_many(w, h, [cand], damp, block_size, clip_search)[0]


def gptq_quantize_many(w: torch.Tensor, h: torch.Tensor, cands: list[Candidate], damp: float = 0.01,
                       block_size: int = 128, clip_search: bool = True) -> list[QuantizedMatrix]:
    """GPTQ of w [N, K] under each candidate, given the input Hessian h [K, K].

    Rotated candidates quantize W R on R^T H R (the output error is the same in either basis).
    Act-order (columns by descending diag H) when the candidate asks for it; damping of
    `damp` times the mean diagonal; the upper Cholesky factor of H^-1; lazy updates in blocks
    that are a multiple of the group size; each group's scale (and min) computed from the
    error-updated weights when the sweep reaches the group. Rows are independent in GPTQ, so
    candidates sharing group size, symmetry and ordering run as one sweep over stacked copies
    of W (per-row widths), which is what makes measuring many candidates affordable.
    """
    w = w.float()
    n, k = w.shape
    layouts = [c.layout(k, n) for c in cands]
    batches: dict[tuple, list[int]] = {}
    for i, (c, lay) in enumerate(zip(cands, layouts)):
        batches.setdefault((lay.group_size, c.asym, c.act_order, c.rotate), []).append(i)
    results: list[QuantizedMatrix | None] = [None] * len(cands)
    signs = random_signs(k) if any(c.rotate for c in cands) else None
    factors: dict[tuple, tuple] = {}  # one Cholesky per basis and column order, shared by the sweeps using it
    for (g, asym, act_order, rotated), members in batches.items():
        order_key = (rotated, act_order, g if act_order == "group" else None)
        if order_key not in factors:
            if rotated:
                factors[order_key] = _ordered_factor(rotate(w, signs), rotate(rotate(h, signs).T, signs), g,
                                                     act_order, damp)
            else:
                factors[order_key] = _ordered_factor(w, h, g, act_order, damp)
        outs = _gptq_sweep(factors[order_key], [layouts[i] for i in members], g, asym, block_size, clip_search,
                           signs if rotated else None)
        for i, out in zip(members, outs):
            results[i] = out
    return results


def act_order_permutation(diag: torch.Tensor, g: int, mode: bool | str) -> torch.Tensor:
    """Column order for GPTQ: by descending Hessian diagonal (True), whole groups of g original
    columns by their summed diagonal ("group": keeps an existing group grid, e.g. Q4_1 blocks,
    intact while still giving the important groups the wide codes), or unchanged (False)."""
    k = diag.shape[0]
    if mode == "group":
        order = torch.argsort(diag.view(k // g, g).sum(1), descending=True, stable=True)
        return (order[:, None] * g + torch.arange(g)).flatten()
    if mode:
        return torch.argsort(diag, descending=True, stable=True)
    return torch.arange(k)


def _inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    k = h.shape[0]
    for attempt in range(4):
        hd = _damped(h, damp * 10 ** attempt)
        # The upper Cholesky factor U of H^-1 (H^-1 = U^T U) without forming H^-1: with J the
        # reversal, J H J = M M^T gives H = R R^T for the upper R = J M J, so U = R^-1.
        try:
            r = torch.linalg.cholesky(hd.flip(0, 1)).flip(0, 1)
        except RuntimeError:
            continue
        hinv = torch.linalg.solve_triangular(r, torch.eye(k, dtype=r.dtype), upper=True)
        if torch.isfinite(hinv).all():
            return hinv
    raise QuantizationError("the calibration Hessian is not positive definite even with heavy damping")


def _ordered_factor(w, h, g, act_order, damp) -> tuple:
    """(w with dead inputs zeroed, column order, upper Cholesky factor of the reordered H^-1, its diag H)."""
    h = h.float().clone()
    w = w.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = act_order_permutation(torch.diag(h), g, act_order)
    h = h[perm][:, perm]
    return w, perm, _inverse_factor(h, damp), torch.diag(h)


def _gptq_sweep(factor, layouts, g, asym, block_size, clip_search, signs) -> list[QuantizedMatrix]:
    w, perm, hinv, hdiag = factor
    n, k = w.shape
    c = len(layouts)
    groups = k // g
    row_bits = torch.tensor([lay.group_bits for lay in layouts], dtype=torch.float32)  # [c, groups]
    W = w[:, perm].T.contiguous().repeat(1, c)  # [K, c*N]: row = one input column of every copy
    q = torch.empty(k, c * n, dtype=torch.uint8)
    grid = code_grid(W, [row_bits[:, gi].repeat_interleave(n) for gi in range(groups)], g, asym)
    steps = grid.steps
    scales = torch.empty(groups, c * n)
    mins = torch.empty(groups, c * n) if asym else None
    block = max(g, (block_size // g) * g)
    pivots = hinv.diagonal().tolist()  # Python floats: no tensor made per column
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = W[i1:i2].clone()
        err1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                gi = col // g
                bits = row_bits[:, gi].repeat_interleave(n)
                sf, mf = group_params(w1[i:i + g].T, bits, asym, clip_search, hdiag[col:col + g], steps)
                scales[gi] = sf
                maxq, half = _levels(bits, sf)
                if asym:
                    mins[gi] = mf
                    inv, lo, hi = 1 / sf, torch.zeros_like(sf), maxq
                else:
                    lo, hi = -half, half - 1
            x = w1[i]
            qc = (x - mf).mul_(inv) if asym else x / sf
            qc.round_().clamp_(lo, hi)
            deq = torch.addcmul(mf, qc, sf) if asym else qc * sf
            q[col] = qc if asym else qc.add_(half)  # exact small integers: the uint8 copy is exact
            e = torch.sub(x, deq, out=err1[i]).div_(pivots[col])
            # Rank-1 updates only inside the current run of 32 columns; each finished run updates
            # the rest of the block at once (same result, matrix-matrix instead of many rank-1s).
            run_end = min(i - i % INNER + INNER, i2 - i1)
            if i + 1 < run_end:
                w1[i + 1:run_end].addr_(hinv1[i, i + 1:run_end], e, alpha=-1)
            elif run_end < i2 - i1:
                run = slice(run_end - INNER, run_end)
                w1[run_end:].addmm_(hinv1[run, run_end:].T, err1[run], alpha=-1)
        if i2 < k:
            W[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1)
    if not torch.isfinite(scales).all():
        raise QuantizationError("GPTQ produced non-finite scales (weights or Hessian hold NaN/inf)")
    # Every candidate's copy side by side; only ever sliced into one result per candidate.
    stacked = QuantizedMatrix(layouts[0], q.long(), scales, mins, perm, grid, signs)
    return [stacked.columns(slice(j * n, (j + 1) * n), lay) for j, lay in enumerate(layouts)]


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """Relative output error tr((W-Ŵ) H (W-Ŵ)^T) / tr(W H W^T) for inputs with Hessian h."""
    d = (w.float() - w_hat.float())
    num = torch.einsum("nk,kl,nl->", d, h, d)
    den = torch.einsum("nk,kl,nl->", w.float(), h, w.float())
    return float(num / den) if float(den) > 0 else math.inf
