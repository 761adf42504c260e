"""The read-stream count chosen at load: the default unless another is clearly faster, from a
model's first weights in model order."""

from __future__ import annotations

import pytest

from qrun.kernels import read_streams
from qrun.kernels.read_streams import DEFAULT_READ_STREAMS, fastest_for, fastest_read_streams


@pytest.mark.parametrize("costs, chosen", [({1: 3, 2: 2, 4: 5}, 2), ({1: 4.95, 2: 5, 4: 5}, 4),
                                           ({1: 9, 2: 9, 4: 5}, 4)])
def test_fastest_read_streams_keeps_the_default_unless_another_count_is_clearly_faster(monkeypatch, costs, chosen):
    clock = [0.0]
    monkeypatch.setattr(read_streams.time, "perf_counter", lambda: clock[0])

    def sweep(streams):
        clock[0] += costs[streams]

    assert fastest_read_streams(sweep) == chosen


def test_a_count_is_judged_against_the_default_in_the_same_round_not_by_its_own_times(monkeypatch):
    # the machine slows from round to round; count 2 beats the default only in the slowest round, by enough there that
    # its own times' median is the lowest of the three, while count 1 beats the default by 10% in every round
    slowdown = [1.0, 2.0, 3.0]
    against_default = {1: [0.9, 0.9, 0.9], 2: [1.1, 1.1, 0.5], 4: [1.0, 1.0, 1.0]}
    clock, calls = [0.0], []

    def sweep(streams):
        rounds_done = len(calls) // 3 - 1  # after one untimed sweep of each count
        calls.append(streams)
        if rounds_done >= 0:
            clock[0] += slowdown[rounds_done] * against_default[streams][rounds_done]

    monkeypatch.setattr(read_streams.time, "perf_counter", lambda: clock[0])
    assert fastest_read_streams(sweep, repeats=3) == 1


def test_every_other_round_times_the_counts_in_reverse_so_none_always_follows_the_same_one():
    calls = []
    fastest_read_streams(calls.append, repeats=3)
    assert calls == [1, 2, 4] + [1, 2, 4] + [4, 2, 1] + [1, 2, 4]


def test_fastest_for_times_the_first_products_within_the_budget_in_model_order(monkeypatch):
    calls = []
    monkeypatch.setattr(read_streams, "fastest_read_streams", lambda sweep: sweep(2) or 2)
    products = [(lambda streams, i=i: calls.append((i, streams)), 100) for i in range(5)]
    assert fastest_for(products, budget_bytes=250) == 2
    assert calls == [(0, 2), (1, 2), (2, 2)]


def test_fastest_for_no_products_is_the_default():
    assert fastest_for([]) == DEFAULT_READ_STREAMS


def test_fastest_for_never_makes_the_products_past_the_budget(monkeypatch):
    made = []
    monkeypatch.setattr(read_streams, "fastest_read_streams", lambda sweep: 1)

    def products():
        for i in range(5):
            made.append(i)
            yield (lambda streams: None), 100

    assert fastest_for(products(), budget_bytes=250) == 1
    assert made == [0, 1, 2]
