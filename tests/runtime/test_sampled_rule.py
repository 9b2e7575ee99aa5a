"""The sampled acceptance rule's graph plumbing (runtime/speculative.py `_SampledRule`), on the CPU: a stand-in
"graph" whose replay runs the rule on the static buffers, so the copies into them, the uniforms' fill and the
returned token are checked against the eager rule with the same draws; plus the cache bound and the fallback."""

import pytest
import torch

from runtime import speculative
from runtime.sampling import RULE_GRAPHS_KEPT, SamplingParams

V = 16


class _ReplayGraph:
    def __init__(self, fn):
        self.fn, self.out = fn, None

    def replay(self):
        acc, tok = self.fn()
        self.out[0].copy_(acc)
        self.out[1].copy_(tok)


def _fake_capture(fn):
    g = _ReplayGraph(fn)
    acc, tok = fn()
    g.out = (acc.clone(), tok.clone())
    return g, g.out


@pytest.fixture
def graphed(monkeypatch):
    """A `_SampledRule` on the CPU that takes its graph path, with `capture` replaced by the stand-in."""
    import runtime.gpu.capture as cap

    monkeypatch.setattr(cap, "capture", _fake_capture)
    rule = speculative._SampledRule(torch.device("cpu"))
    rule.enabled = True
    return rule


def _window(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m + 1, V, generator=g) * 2
    q = torch.softmax(torch.randn(m, V, generator=g) * 2, -1) if m else None
    draft = torch.multinomial(q, 1, generator=g)[:, 0] if m else None
    return logits, draft, q


@pytest.mark.parametrize("m,keep", [(0, None), (3, None), (3, 2)])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=5)])
def test_graph_path_gives_the_eager_tokens(graphed, m, keep, sp):
    eager = speculative._SampledRule(torch.device("cpu"))
    assert not eager.enabled                          # a CPU runs the ops eagerly
    for seed in range(6):                             # one rule object, several windows: buffers are reused
        logits, draft, q = _window(m, seed)
        k = torch.tensor(keep) if keep is not None else None
        a1, t1 = graphed(logits, draft, q, k, sp, torch.Generator().manual_seed(seed))
        a0, t0 = eager(logits, draft, q, k, sp, torch.Generator().manual_seed(seed))
        assert int(a1) == int(a0) and t1.tolist() == t0.tolist()
    assert len(graphed.graphs) == 1 and not graphed.errors


def test_the_returned_token_is_not_the_graphs_buffer(graphed):
    """The token becomes the next window's anchor: the next replay must not change it."""
    sp = SamplingParams(temperature=1.0)
    logits, _, _ = _window(0, 1)
    _, t = graphed(logits, None, None, None, sp, torch.Generator().manual_seed(1))
    first = t.tolist()
    for s in range(2, 12):
        graphed(_window(0, s)[0], None, None, None, sp, torch.Generator().manual_seed(s))
    assert t.tolist() == first


def test_at_most_the_kept_graphs_most_recent_first(graphed):
    logits, _, _ = _window(0, 0)
    temps = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    for t in temps:
        graphed(logits, None, None, None, SamplingParams(temperature=t), torch.Generator().manual_seed(0))
    assert len(graphed.graphs) == RULE_GRAPHS_KEPT
    kept = {k[-1][0] for k in graphed.graphs}
    assert kept == set(temps[-RULE_GRAPHS_KEPT:])
    graphed(logits, None, None, None, SamplingParams(temperature=temps[-4]), torch.Generator().manual_seed(0))
    assert next(reversed(graphed.graphs))[-1][0] == temps[-4]          # used again: now the most recent


def test_a_failed_capture_falls_back_to_the_eager_ops(monkeypatch):
    import runtime.gpu.capture as cap

    def broken(fn):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(cap, "capture", broken)
    rule = speculative._SampledRule(torch.device("cpu"))
    rule.enabled = True
    sp = SamplingParams(temperature=0.7)
    logits, draft, q = _window(2, 3)
    with pytest.warns(RuntimeWarning, match=r"the sampled acceptance rule's CUDA graph failed here \(RuntimeError: "
                                            r"capture refused\); its eager ops from now on"):
        a, t = rule(logits, draft, q, None, sp, torch.Generator().manual_seed(5))
    assert not rule.enabled and "capture refused" in rule.errors[0]
    a0, t0 = speculative._SampledRule(torch.device("cpu"))(logits, draft, q, None, sp,
                                                           torch.Generator().manual_seed(5))
    assert int(a) == int(a0) and t.tolist() == t0.tolist()


def test_a_window_without_its_draft_distribution_is_refused():
    logits, draft, _ = _window(2, 0)
    with pytest.raises(RuntimeError, match="no draft distribution"):
        speculative._SampledRule(torch.device("cpu"))(logits, draft, None, None, SamplingParams(temperature=1.0),
                                                      torch.Generator())


def test_only_target_only_windows_and_full_blocks_get_graphs(graphed, monkeypatch):
    """The shorter windows at a generation's end run eagerly: each would be a graph of its own."""
    monkeypatch.setitem(speculative._RULES, "cpu", graphed)
    sp = SamplingParams(temperature=0.9)
    for m in (3, 2, 1, 0):
        logits, draft, q = _window(m, m)
        speculative._accept_sampled_window(logits, draft, q, sp, torch.Generator().manual_seed(0), block=4)
    assert {k[2] for k in graphed.graphs} == {None, 3}       # m = 0 (no draft) and the full block
