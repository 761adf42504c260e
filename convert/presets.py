"""`qrun convert --preset`: how much the converter searches and how much text it reads.

A preset is the candidate list the measurement tries on every block plus the calibration and
GPTQ settings; `fast`, `default` and `best` trade conversion time and memory for the KL the
optimizer can reach at a given bits per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from qrun.convert.gptq import Candidate


def _c(g, bits, asym=False, act_order=True, rotate=False):
    return Candidate(g, tuple(bits), asym, act_order, rotate)


# EXL2-style: widest codes on the most important input groups, in descending runs. "g128" is
# snapped per matrix to the largest multiple of 32 dividing K (96 for K = 576). 4-bit group-32
# asymmetric in the original column order reproduces a Q4_1 source up to its 8-bit scale codes
# at ~4.56 bpw; the group-act-order g32 mixes keep that block grid while moving bits between
# whole blocks. Below ~3.5 bpw the rotated candidates (incoherence processing) win: on SmolLM2
# they cut the output error of 2- and 3-bit matrices by 10-25% at equal group size, and act-order
# no longer pays for its permutation. Every default candidate was picked at some target between
# 2.3 and 6 bpw on SmolLM2; the ones never picked there are in the best preset only.
_ROTATED = [_c(128, [(2, 1.0)], act_order=False, rotate=True),
            _c(128, [(2, 1.0)], asym=True, act_order=False, rotate=True),
            _c(128, [(3, 1.0)], asym=True, act_order=False, rotate=True)]
_ROTATED_4B = _c(128, [(4, 1.0)], asym=True, act_order=False, rotate=True)
_SOURCE_GRID = _c(32, [(4, 1.0)], asym=True, act_order=False)
_SOURCE_GRID_MIX = _c(32, [(4, 0.5), (3, 0.5)], asym=True, act_order="group")
# Fast: few GPTQ sweeps (one per group size, symmetry, order and basis), since each costs a pass.
CANDIDATES_FAST = _ROTATED[1:] + [
    _ROTATED_4B,
    _c(128, [(8, 1.0)], asym=True, act_order=False, rotate=True),
    _SOURCE_GRID,
    _SOURCE_GRID_MIX,
]
CANDIDATES_DEFAULT = _ROTATED + [
    _c(256, [(3, 1.0)], asym=True, act_order=False, rotate=True),
    _c(512, [(3, 1.0)], asym=True, act_order=False, rotate=True),
    _ROTATED_4B,
    _c(128, [(3, 0.5), (2, 0.5)]),
    _c(128, [(3, 0.25), (2, 0.75)]),
    _c(128, [(6, 1.0)]),
    _c(128, [(8, 1.0)]),
    _c(128, [(2, 1.0)], asym=True),
    _c(128, [(3, 1.0)], asym=True),
    _SOURCE_GRID,
    _c(32, [(4, 0.25), (3, 0.75)], asym=True, act_order="group"),
    _SOURCE_GRID_MIX,
    _c(32, [(3, 1.0)], asym=True, act_order="group"),
]
CANDIDATES_BEST = CANDIDATES_DEFAULT + [
    _c(128, [(2, 1.0)]),
    _c(128, [(3, 1.0)]),
    _c(128, [(4, 1.0)]),
    _c(128, [(4, 0.5), (3, 0.5)]),
    _c(128, [(4, 0.25), (3, 0.75)]),
    _c(128, [(4, 1.0)], asym=True),
    _c(64, [(2, 1.0)], asym=True, act_order=False, rotate=True),
    _c(64, [(3, 1.0)], asym=True, act_order=False, rotate=True),
    _c(256, [(4, 1.0)], asym=True, act_order=False, rotate=True),
    _c(128, [(5, 1.0)]),
    _c(32, [(4, 0.75), (3, 0.25)], asym=True, act_order="group"),
    _c(32, [(5, 0.25), (4, 0.75)], asym=True, act_order="group"),
    _c(128, [(4, 0.75), (3, 0.25)]),
    _c(128, [(5, 0.5), (4, 0.5)]),
    _c(128, [(8, 0.1), (4, 0.9)]),
    _c(128, [(3, 0.75), (2, 0.25)]),
    _c(64, [(2, 1.0)], asym=True),
    _c(64, [(3, 1.0)], asym=True),
    _c(32, [(4, 0.125), (3, 0.875)], asym=True, act_order="group"),
    _c(32, [(4, 0.375), (3, 0.625)], asym=True, act_order="group"),
    _c(32, [(4, 0.625), (3, 0.375)], asym=True, act_order="group"),
    _c(32, [(4, 0.875), (3, 0.125)], asym=True, act_order="group"),
]


@dataclass(frozen=True)
class Preset:
    """The converter's knobs; each buys quality with time or memory.

    candidates: the layouts the measurement tries on every block. Each costs a GPTQ sweep and a
        block forward per block, so measuring takes time in proportion; more of them let the
        optimizer reach a lower KL at the same bits.
    rows, row_len: calibration rows and tokens per row (unless --calib-rows/--calib-len say).
        More tokens estimate each input's Hessian better; every pass takes time and the stored
        residual-stream states take memory in proportion to rows * row_len.
    score_rows: the first rows, on which the measurement scores block outputs (error and KL, with
        one sensitivity backward pass over them) and which the quantize pass holds out of the
        drift correction's fit to decide whether it helps. More make both decisions less noisy
        and leave fewer rows to fit.
    clip_search: try several clippings of each group's range (gptq.CLIP_GRID) and keep the best:
        lower error where a few outliers stretch a group, that many times the work per group.
    correct_drift: the quantize pass aims every matrix at the full-precision model's output
        where that lowers the held-out error (convert/quantize.py); it runs the full-precision
        stream beside the quantized one, one more forward and one more set of states per layer.
    """

    candidates: tuple[Candidate, ...]
    rows: int
    row_len: int
    score_rows: int
    clip_search: bool
    correct_drift: bool


PRESETS = {
    "fast": Preset(tuple(CANDIDATES_FAST), rows=8, row_len=256, score_rows=1, clip_search=False,
                   correct_drift=False),
    "default": Preset(tuple(CANDIDATES_DEFAULT), rows=32, row_len=512, score_rows=2, clip_search=True,
                      correct_drift=True),
    "best": Preset(tuple(CANDIDATES_BEST), rows=128, row_len=512, score_rows=8, clip_search=True,
                   correct_drift=True),
}
