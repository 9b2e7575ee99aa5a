"""spec_min_p with sampling stays lossless for DFlash2 (docs/models.md, "Speculative decoding"): the floor statistic is the chosen
candidate's T=1 selector probability, so whether a row is kept depends on the token drawn there; the verifier must
then see q restricted to the floor. The unit cases below isolate that rule (one row against a uniform target: the
emitted token must be uniform; accepting against the unrestricted q gives the high-q token about 0.33 instead of
0.25). The end-to-end checks are a head trained on the target, through the real loop, against the exact
distribution of target-only sampling (below), and tests/runtime/test_speculative_distribution.py (random heads,
MTP too, and the check's power against an unrestricted q)."""

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


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory):
    """A head trained on the tiny target's own greedy continuation until its greedy walk accepts 2 proposals a
    window (trained-shaped: confident selector rows, non-zero codebooks, every row conditioned on the previous)."""
    from runtime.kv import KVCache
    from runtime.speculative import generate_ids
    from tests.runtime.drafters.dflash2.helpers import drafter_config, train_on_sequence, write_hf_drafter
    from tests.runtime.test_speculative_distribution import PROMPT, make_target_and_head

    model, _, _ = make_target_and_head(tmp_path_factory.mktemp("target"))
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 128)
    cont = generate_ids(model, kv, PROMPT, max_new_tokens=60, stop_ids=set()).token_ids
    cfg = drafter_config(hidden=32, inter=64, vocab=8, heads=2, kv_heads=1, head_dim=16, taps=(0, 2),
                         num_target_layers=3, block_size=4, top_k=4, rank=8)
    state = train_on_sequence(cfg, model, torch.tensor(PROMPT + cont), first_anchor=len(PROMPT) - 1,
                              until_runs=2.0, walk_from=len(PROMPT))
    return model, write_hf_drafter(tmp_path_factory.mktemp("trained") / "head", cfg, state)


def test_floor_with_a_trained_head_through_the_real_loop(trained_head, monkeypatch):
    """Temperature 0.5, top-k 6, top-p 0.95, floor 0.5: the trained head has most proposals accepted and the floor
    cuts some rows, and the sampled output still follows target-only sampling (chi-square at 1e-3 on the marginals
    and adjacent pairs of 4 new tokens, 1000 fixed seeds; exact distribution by enumeration)."""
    import itertools

    import tests.runtime.test_speculative_distribution as dist
    from runtime.drafters.dflash2.loading import load_dflash2_drafter
    from runtime.sampling import probs

    model, head = trained_head
    sp = SamplingParams(temperature=0.5, top_k=6, top_p=0.95)
    monkeypatch.setattr(dist, "SP", sp)
    seqs = torch.tensor(list(itertools.product(range(dist.V), repeat=dist.DEPTH)))
    ids = torch.cat([torch.tensor(dist.PROMPT).expand(seqs.shape[0], -1), seqs], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(dist.PROMPT) - 1: -1]
    joint = probs(logits, sp).gather(-1, seqs[..., None])[..., 0].prod(-1).view((dist.V,) * dist.DEPTH)
    counts, proposed, accepted, rec = dist.sample(model, load_dflash2_drafter(head, model, context=32), 0.5)
    assert accepted > proposed / 2                      # a trained head: most proposals are accepted
    assert 0 < rec.got < rec.asked                      # and the floor cut some rows
    ps = dist.pvalues(counts, joint)
    assert min(ps) > dist.ALPHA, ps
