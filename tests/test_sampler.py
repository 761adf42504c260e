"""The sampler's pieces that stand alone."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from qrun.sampler import first_max


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 300), levels=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_first_max_is_argmax_ties_included(rows, width, levels, seed):
    """Few distinct values, so most rows tie for their maximum: the first index wins, as argmax's."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (rows, width), generator=gen).float()
    values[values == 0] = float("-inf")
    assert torch.equal(first_max(values), values.argmax(dim=-1))
