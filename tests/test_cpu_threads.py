"""The engine runs on the cores other processes leave free, re-deciding as the load changes."""

import pytest
import torch
from hypothesis import given, strategies as st

from qrun import cpu_threads
from qrun.cpu_threads import CpuThreads, threads_for


@pytest.mark.parametrize("others,expected", [(0.0, 2), (0.3, 2), (0.7, 1), (1.0, 1), (2.0, 1)])
def test_two_cores_give_one_up_to_a_busy_process(others, expected):
    assert threads_for(2, 2, others) == expected


@given(st.integers(1, 64), st.integers(1, 64), st.floats(0, 128))
def test_thread_count_stays_within_one_and_the_starting_count(max_threads, cores, others):
    assert 1 <= threads_for(max_threads, cores, others) <= max_threads


@pytest.fixture
def fake_machine(monkeypatch):
    """A 2-core machine whose busy seconds (all processes, and ours) the test advances by hand."""
    clock = {"now": 0.0, "machine": 0.0, "own": 0.0}
    monkeypatch.delenv("QRUN_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(cpu_threads, "_cores_busy_s", lambda cores: clock["machine"])
    monkeypatch.setattr(cpu_threads, "_own_busy_s", lambda: clock["own"])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield clock
    torch.set_num_threads(before)


def advance(clock, seconds, own_cores, other_cores):
    clock["now"] += seconds
    clock["own"] += own_cores * seconds
    clock["machine"] += (own_cores + other_cores) * seconds


def test_a_busy_core_drops_a_thread_and_a_quiet_machine_restores_it(fake_machine):
    threads = CpuThreads()
    advance(fake_machine, 2, own_cores=2, other_cores=0)
    threads.update()
    assert torch.get_num_threads() == 2
    advance(fake_machine, 2, own_cores=1.1, other_cores=0.9)
    threads.update()
    assert torch.get_num_threads() == 1
    advance(fake_machine, 2, own_cores=1, other_cores=1)  # still busy: stays at one
    threads.update()
    assert torch.get_num_threads() == 1
    advance(fake_machine, 2, own_cores=1, other_cores=0)
    threads.update()
    assert torch.get_num_threads() == 2


def test_decisions_wait_for_a_full_interval(fake_machine):
    threads = CpuThreads()
    advance(fake_machine, 0.2, own_cores=0, other_cores=2)
    threads.update()
    assert torch.get_num_threads() == 2


def test_an_explicit_thread_count_is_kept(fake_machine, monkeypatch):
    monkeypatch.setenv("QRUN_THREADS", "1")
    threads = CpuThreads()
    assert torch.get_num_threads() == 1
    advance(fake_machine, 2, own_cores=1, other_cores=0)
    threads.update()
    assert torch.get_num_threads() == 1


def test_a_malformed_thread_count_names_the_variable(monkeypatch):
    monkeypatch.setenv("QRUN_THREADS", "two")
    with pytest.raises(ValueError, match="QRUN_THREADS"):
        CpuThreads()
