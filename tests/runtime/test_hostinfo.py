"""The CPU thread choice (runtime/hostinfo.py): what the process may use, how busy it is, and a measured pick."""

from __future__ import annotations

import os

import pytest
import torch

from runtime import hostinfo
from runtime.hostinfo import choose_threads, idle_cpus, thread_candidates, usable_cpus


def test_usable_cpus_is_the_affinity_mask_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == 3


@pytest.mark.parametrize(("usable", "load", "total", "idle"), [
    (8, 0.0, 8, 8), (8, 4.0, 8, 4), (8, 20.0, 8, 1), (2, 8.0, 16, 1), (4, 2.0, 16, 4), (2, 3.1, 2, 1),
])
def test_idle_cpus_takes_the_load_share_away(usable, load, total, idle):
    assert idle_cpus(usable, load, total) == idle


def test_candidates_are_powers_of_two_and_the_idle_count():
    assert thread_candidates(1) == [1]
    assert thread_candidates(6) == [1, 2, 4, 6]
    assert thread_candidates(8) == [1, 2, 4, 8]


@pytest.mark.parametrize(("times", "pick"), [
    ({1: 1.0, 2: 0.55, 4: 0.3, 8: 0.2}, 8),        # an idle machine and a model that scales
    ({1: 0.1, 2: 0.9, 4: 3.0, 8: 5.0}, 1),         # busy cores: OpenMP threads wait for each other
    ({1: 1.0, 2: 0.95, 4: 0.97, 8: 1.2}, 1),       # more threads, barely faster: not worth it (margin 10%)
    ({1: 1.0, 2: 0.5, 4: 0.48, 8: 0.6}, 2),
])
def test_the_fastest_count_wins_and_fewer_threads_break_near_ties(times, pick):
    seen = []

    def probe(n):
        seen.append(n)
        return times[n]

    c = choose_threads(usable=8, load=0.0, probe=probe)
    assert seen == [1, 2, 4, 8] and c.threads == pick and c.probe_s == times
    assert c.to_dict()["threads"] == pick and "probe" in c.reason


def test_one_free_cpu_needs_no_probe(monkeypatch):
    def never(n):
        raise AssertionError("probed although one CPU is free")

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    c = choose_threads(usable=2, load=3.1, probe=never)
    assert c.threads == 1 and c.idle == 1 and "one is free" in c.reason


def test_the_real_probe_is_short_and_leaves_torch_as_it_was():
    before = torch.get_num_threads()
    c = choose_threads(usable=2, load=0.0, hidden=64, inner=128)
    assert c.threads in (1, 2) and set(c.probe_s) == {1, 2} and all(t > 0 for t in c.probe_s.values())
    assert sum(c.probe_s.values()) < 1.0 and torch.get_num_threads() == before
    assert hostinfo.load_average() is None or hostinfo.load_average() >= 0
