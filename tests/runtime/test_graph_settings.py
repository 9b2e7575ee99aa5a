"""A drafter graph set keeps its sampled proposals' graphs for at most SAMPLED_SETTINGS_KEPT sampling settings
(runtime/gpu/capture.py `GraphSet`): checked on the CPU with a stand-in capture that records what is made."""

import pytest
import torch

import runtime.gpu.capture as cap
from runtime.sampling import SamplingParams, sampling_key


class _Graph:
    def replay(self):
        pass


@pytest.fixture
def graph_set(monkeypatch):
    made = []

    def fake(fn):
        made.append(fn)
        return _Graph(), fn()

    monkeypatch.setattr(cap, "capture", fake)
    gs = cap.GraphSet(torch.device("cpu"))
    gs.cuda = True                       # take the graph path (the capture is the stand-in)
    gs.made = made
    return gs


def _sk(t: float):
    return sampling_key(SamplingParams(temperature=t, top_p=0.9))


def test_greedy_and_observe_graphs_stay_and_sampled_settings_are_bounded(graph_set):
    gs = graph_set
    gs._run("observe", lambda: 0)
    for n in (3, 2, 1):
        gs._run(("chain", n, None), lambda: 0)
    temps = [0.5, 0.6, 0.7, 0.8]
    for t in temps:
        for n in (3, 2):
            gs._run(("chain", n, _sk(t)), lambda: 0)
    kept = {k[-1] for k in gs.graphs if isinstance(k, tuple) and k[-1] is not None}
    assert kept == {_sk(t) for t in temps[-cap.SAMPLED_SETTINGS_KEPT:]}
    assert "observe" in gs.graphs and all(("chain", n, None) in gs.graphs for n in (3, 2, 1))
    assert len(gs.graphs) == 1 + 3 + 2 * cap.SAMPLED_SETTINGS_KEPT


def test_a_setting_used_again_is_kept_and_not_captured_again(graph_set):
    gs = graph_set
    gs._run(("draft", 8, _sk(0.5)), lambda: 0)
    gs._run(("draft", 8, _sk(0.6)), lambda: 0)
    gs._run(("draft", 8, _sk(0.5)), lambda: 0)          # 0.5 is now the most recent
    before = len(gs.made)
    gs._run(("draft", 8, _sk(0.7)), lambda: 0)          # drops 0.6, not 0.5
    assert len(gs.made) == before + 1
    assert ("draft", 8, _sk(0.5)) in gs.graphs and ("draft", 8, _sk(0.6)) not in gs.graphs
    gs._run(("draft", 8, _sk(0.5)), lambda: 0)
    assert len(gs.made) == before + 1                   # replayed, not captured again
