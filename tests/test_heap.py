"""HeapTrimmer: how often a serving engine hands freed memory back to the operating system."""

from __future__ import annotations

import qrun.heap as heap


def trimmer_counting_trims(monkeypatch, interval_s: float) -> tuple[heap.HeapTrimmer, list[int], list[float]]:
    now = [0.0]
    monkeypatch.setattr(heap.time, "monotonic", lambda: now[0])
    trimmer = heap.HeapTrimmer(interval_s)
    trims = []
    trimmer._malloc_trim = trims.append
    return trimmer, trims, now


def test_steps_trim_at_most_once_per_interval(monkeypatch):
    trimmer, trims, now = trimmer_counting_trims(monkeypatch, interval_s=30)
    for second in range(0, 100, 5):
        now[0] = second
        trimmer.after_step()
    assert len(trims) == 3  # at 30, 60 and 90 s


def test_going_idle_trims_once_and_only_after_work(monkeypatch):
    trimmer, trims, now = trimmer_counting_trims(monkeypatch, interval_s=30)
    trimmer.on_idle()
    assert trims == []  # nothing was freed yet
    trimmer.after_step()
    trimmer.on_idle()
    trimmer.on_idle()
    assert len(trims) == 1


def test_the_trim_is_glibcs_where_there_is_one():
    trim = heap._malloc_trim()
    assert trim is None or trim(0) in (0, 1)
