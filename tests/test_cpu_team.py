"""The step's held team (kernels/cpu_kernels.h's QrunTeam) runs every item of a claimed loop exactly once, its
threads take over the items of one that falls behind, and its waiting threads warm ahead of the next job until it
comes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.kernels import cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 5000), threads=st.integers(1, 3), holder_spin_ns=st.sampled_from([0, 0, 200, 3000]))
def test_every_item_of_a_claimed_loop_runs_once_on_one_of_the_teams_threads(count, threads, holder_spin_ns):
    ran = torch.ops.qrun.team_claims(count, threads, holder_spin_ns if count < 500 else 0)
    assert len(ran) == count
    assert all(0 <= part < threads for part in ran), "an item ran twice (-2), never (-1) or off the team"


def test_the_other_threads_take_the_items_of_a_holder_that_falls_behind():
    # the holder spends 200 us on each of its items, the other thread none: in equal halves the other would run 32,
    # and it takes over the holder's even if it starts a few milliseconds late
    ran = torch.ops.qrun.team_claims(64, 2, 200_000)
    assert sorted(set(ran)) == [0, 1]
    assert ran.count(1) > 40, f"the other thread ran {ran.count(1)} of 64 items"


def test_team_claims_refuses_a_negative_count():
    with pytest.raises(RuntimeError, match="count must be in"):
        torch.ops.qrun.team_claims(-1, 2, 0)


@pytest.mark.parametrize("threads", [2, 3])
def test_each_waiting_thread_warms_once_between_jobs_until_the_next_job_comes(threads):
    warmed, stopped = torch.ops.qrun.team_warm(threads)
    # the holder never warms; each other thread runs the first warm posted between two jobs once (1), not the second
    # (100), and leaves it when the job comes rather than at its 2 s limit
    assert warmed == [0] + [1] * (threads - 1)
    assert stopped == [0] + [1] * (threads - 1)


def test_a_team_of_one_thread_warms_nothing():
    assert torch.ops.qrun.team_warm(1) == ([0], [0])
