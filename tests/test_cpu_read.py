"""The benchmark's read-bandwidth probe (kernels/cpu_read.cpp) reads every element once, whatever the stream count,
length and threads: its sum is the buffer's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.kernels import cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


@settings(max_examples=40, deadline=None)
@given(length=st.integers(0, 20_000), streams=st.sampled_from([1, 2, 4, 8]), threads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_read_sum_is_the_buffers_sum_for_every_stream_count(length, streams, threads, seed):
    x = torch.randn(length, generator=torch.Generator().manual_seed(seed))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.qrun.read_sum(x, streams)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, x.double().sum(), rtol=1e-5, atol=1e-3)


def test_read_sum_refuses_a_stream_count_it_has_no_loop_for():
    with pytest.raises(RuntimeError, match="streams must be 1, 2, 4 or 8"):
        torch.ops.qrun.read_sum(torch.ones(64), 3)

