"""The sampler and its pieces that stand alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun import kernels
from qrun.kernels import cpu_library
from qrun.kernels.argmax import first_max_ref
from qrun.kernels.cpu_argmax import first_max_cpu
from qrun.sampler import sample
from qrun.sampling_params import SamplingParams
from qrun.sequence import Sequence

needs_library = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels did not build here")
FIRST_MAX = [first_max_ref, pytest.param(first_max_cpu, marks=needs_library)]


@pytest.mark.parametrize("first_max", FIRST_MAX)
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 300), levels=st.integers(1, 6), nans=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_first_max_is_argmax_ties_and_nans_included(first_max, rows, width, levels, nans, seed):
    """Few distinct values, so most rows tie for their maximum: the first index wins, as argmax's;
    a row holding NaNs answers its first one."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (rows, width), generator=gen).float()
    values[values == 0] = float("-inf")
    for _ in range(nans):
        values[torch.randint(0, rows, (), generator=gen), torch.randint(0, width, (), generator=gen)] = float("nan")
    assert torch.equal(first_max(values), values.argmax(dim=-1))


@needs_library
def test_first_max_cpu_reads_a_vocabulary_and_strided_rows_as_torch_does():
    """Rows as wide as a vocabulary, with their maximum in the vectors' body, their tail, or tied
    across lanes; and a view whose rows lie apart."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 49_157, generator=gen)
    values[1, -1] = 10.0  # in the tail past the last whole vector
    values[2, [17, 33, 49_000]] = 10.0  # tied, in different lanes
    values[3] = float("-inf")
    values[4, 20_000] = float("nan")
    assert torch.equal(first_max_cpu(values), values.argmax(dim=-1))
    assert torch.equal(first_max_cpu(values[:, :1000]), values[:, :1000].argmax(dim=-1))
    assert kernels.ops_for(torch.device("cpu")).first_max is first_max_cpu  # what the sampler takes here


@pytest.mark.parametrize("params, takes_first_max", [
    (SamplingParams(temperature=0), True),
    (SamplingParams(temperature=0, repetition_penalty=50.0), False),  # penalised: the given maximum is stale
    (SamplingParams(temperature=0, min_tokens=3), False),  # its stop tokens held back
    (SamplingParams(temperature=0.8, seed=3), False),  # sampled, not greedy
])
def test_a_given_first_maximum_is_taken_only_where_nothing_rewrites_a_greedy_rows_logits(params, takes_first_max):
    """The C++ model hands its rows' first maxima to the sampler with the logits."""
    logits = torch.full((1, 8), -10.0)
    logits[0, 2] = 5.0  # the row's maximum, a token its sequence has already sampled
    logits[0, 6] = 4.0
    seq = Sequence(0, "r", 0, [1], params, detokenizer=None, arrival_time=0.0, output_token_ids=[2],
                   generator=torch.Generator().manual_seed(3) if params.seed is not None else None)
    stale = [7]  # not the argmax: only a sampler that takes the given maxima answers it
    tokens, _ = sample(logits, [seq], eos_token_ids=[2], first_max=stale)
    assert (tokens == stale) == takes_first_max
    assert sample(logits, [seq], eos_token_ids=[2])[0] != stale
