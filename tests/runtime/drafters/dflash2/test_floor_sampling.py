"""spec_min_p with sampling stays lossless for DFlash2 (docs/models.md, "Speculative decoding"): the floor statistic is the chosen
candidate's T=1 selector probability, so whether a row is kept depends on the token drawn there; the verifier must
then see q restricted to the floor. A one-row window against a uniform target: the emitted token must be uniform
(accepting against the unrestricted q gives the high-q token about 0.33 instead of 0.25)."""

import math
from types import SimpleNamespace

import pytest
import torch

from runtime.drafters.dflash2.model import CandidateSelector, argmax_walk, select_walk
from runtime.sampling import SamplingParams
from runtime.speculative import _accept_sampled

V = 4
TRIALS = 3000
SP = SamplingParams(temperature=1.0)


def _emitted(walk_fn, q_draft, floor, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dlogits = torch.tensor([[math.log(x) for x in q_draft]])
    target = torch.zeros(2, V)                       # p uniform at every position
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        walk = walk_fn(dlogits, floor, gen)
        draft = walk.tokens.tolist()
        _, new = _accept_sampled(target[: len(draft) + 1], draft, walk.q, SP, gen)
        counts[new[0]] += 1
    return counts / TRIALS


def _selector():
    sel = CandidateSelector(SimpleNamespace(selector_top_k=V, hidden_size=8, selector_rank=4, vocab_size=V))
    return sel.requires_grad_(False)       # zero codebooks: score = the drafter's logits over all V candidates


@pytest.mark.parametrize("q_draft, floor", [((0.7, 0.1, 0.1, 0.1), 0.5), ((0.5, 0.3, 0.1, 0.1), 0.2)])
def test_selector_walk_with_floor_is_lossless(q_draft, floor):
    sel, hs = _selector(), torch.randn(1, 8)
    freq = _emitted(lambda lg, f, g: select_walk(sel, hs, lg, 0, min_p=f, temperature=1.0, generator=g),
                    q_draft, floor)
    assert torch.allclose(freq, torch.full((V,), 0.25), atol=0.03), freq


def test_v1_argmax_walk_with_floor_is_lossless():
    freq = _emitted(lambda lg, f, g: argmax_walk(lg, min_p=f, sampling=SP, generator=g), (0.7, 0.1, 0.1, 0.1), 0.5)
    assert torch.allclose(freq, torch.full((V,), 0.25), atol=0.03), freq


def test_floor_q_is_a_distribution_over_passing_candidates():
    sel, hs = _selector(), torch.randn(3, 8)
    lg = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 3))
    w = select_walk(sel, hs, lg, 0, min_p=0.5, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert w.q is not None and torch.allclose(w.q.sum(-1), torch.ones(len(w.tokens)))
    assert (w.q[:, 1:] == 0).all()
