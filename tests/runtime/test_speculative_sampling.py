"""Sampled speculative decoding is lossless: generated tokens follow the target's own distribution.

Chi-square goodness of fit against the exact target distribution (enumerated on a tiny vocabulary), fixed
seeds, so each test is deterministic; the thresholds (p > 1e-3) are what a correct sampler passes and a wrong
residual or acceptance rule fails (checked by breaking them while writing these tests).
"""

import itertools

import pytest
import torch

from runtime.drafters.mtp import MTPDrafter
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.sampling import SamplingParams, gumbel_pick, probs
from runtime.speculative import _accept_sampled, generate_ids
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
V = 8


def chi2_pvalue(counts: torch.Tensor, expected_p: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value; cells with expected count < min_expected are pooled into one."""
    n = counts.sum().item()
    exp = expected_p.double() * n
    small = exp < min_expected
    obs = counts.double()
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    assert torch.all(obs[~keep] == 0), "a token with zero target probability was generated"
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = max(int(exp.numel()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def test_chi2_helper_rejects_a_wrong_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert chi2_pvalue(torch.tensor([500, 300, 200]), p) > 0.9
    assert chi2_pvalue(torch.tensor([400, 350, 250]), p) < 1e-6


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                SamplingParams(temperature=1.3, top_p=0.8)])
def test_accept_rule_is_lossless_on_synthetic_rows(sp):
    """Draft from q, accept/resample: the first committed token follows p, the second (bonus) follows p[1]."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g) * 1.5
    q_logits = torch.randn(1, V, generator=g) * 1.5     # a drafter that disagrees with the target
    p = probs(logits, sp)
    q = probs(q_logits, sp)
    n = 6000
    first = torch.zeros(V, dtype=torch.long)
    second = torch.zeros(V, dtype=torch.long)
    rejected = 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        acc, new = _accept_sampled(logits, [d], q, sp, gen)
        first[new[0]] += 1
        if acc == 1:
            second[new[1]] += 1
        else:
            rejected += 1
    assert 0.05 * n < rejected < 0.95 * n          # both branches were exercised
    assert chi2_pvalue(first, p[0]) > 1e-3
    assert chi2_pvalue(second, p[1]) > 1e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(make_tiny_target(tmp_path_factory.mktemp("samp"), vocab=V, seed=5, scale=3.0))


def _exact_joint(model, prompt, depth, sp):
    """P(t1..t_depth) for target-only sampling, by enumerating every continuation (V**depth rows)."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=depth)))          # [V**d, d]
    ids = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1: -1]                        # rows predicting t1..t_d
    pr = probs(logits, sp)                                                      # [N, d, V]
    step = pr.gather(-1, seqs[..., None])[..., 0]                               # [N, d]
    return step.prod(-1).view((V,) * depth)


def test_mtp_sampling_matches_target_distribution(model):
    sp, block = SamplingParams(temperature=0.9, top_k=6, top_p=0.95), 4
    prompt = [2, 5, 3, 7, 6]
    depth = 3
    joint = _exact_joint(model, prompt, depth, sp)
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32)
    drafter = MTPDrafter(model, 32)
    n = 800
    counts = torch.zeros((V,) * depth, dtype=torch.long)
    proposed = accepted = 0
    for seed in range(n):
        sp_i = SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=seed)
        r = generate_ids(model, kv, prompt, drafter=drafter, block=block, sampling=sp_i, max_new_tokens=depth)
        counts[tuple(r.token_ids)] += 1
        proposed += r.stats["proposed"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < proposed                  # acceptances and rejections both happened
    assert chi2_pvalue(counts.sum((0, 2)), joint.sum((0, 2))) > 1e-3     # t2
    assert chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3     # t3
    assert chi2_pvalue(counts.sum(2).flatten(), joint.sum(2).flatten()) > 1e-3     # (t1, t2) jointly


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
                                SamplingParams(temperature=1.2, top_p=0.7)])
def test_gumbel_pick_draws_from_p(sp):
    """argmax(log p + Gumbel) with uniforms made outside is a draw from p (the graph paths' sampler); a filtered-out
    token is never drawn."""
    g = torch.Generator().manual_seed(4)
    p = probs(torch.randn(V, generator=g) * 2.0, sp)
    n = 20000
    u = torch.rand(n, V, generator=g)
    picks = gumbel_pick(torch.log(p).expand(n, V), u)
    counts = torch.bincount(picks, minlength=V)
    assert chi2_pvalue(counts, p) > 1e-3
    assert int(counts[p == 0].sum()) == 0


def test_probs_filters():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p > 0).sum() == 2 and p[0, 0] > p[0, 2] > 0 and abs(p.sum().item() - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    # top_p keeps the smallest prefix (by probability) whose mass reaches top_p
    p = probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p > 0).sum() == 2
    p = probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) - 1e-3))
    assert (p > 0).sum() == 1 and p[0, 0] == 1
    cold = probs(logits, SamplingParams(temperature=0.05))
    assert cold[0, 0] > 0.999


def test_a_token_the_target_cannot_emit_is_rejected_even_when_u_is_zero(monkeypatch):
    """Reproduction: with top-k 1 every token but the target's argmax has p = 0; a draft of such a token must be
    rejected whatever u is. float32 `torch.rand` returns exactly 0 once in 2^24 draws, and `u * q <= p` then
    accepted it; the strict test does not."""
    import runtime.speculative as spec

    sp = SamplingParams(temperature=1.0, top_k=1)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.5, 0.0, 0.0, 4.0]])
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0]])               # the drafter proposes token 0 (p[0, 0] = 0)
    # u = 0 for the proposal's test; the draw's uniforms (m + V in one fill) any valid value
    monkeypatch.setattr(spec, "_uniforms", lambda n, gen, device, out=None: torch.cat(
        (torch.zeros(1, device=device), torch.full((n - 1,), 0.5, device=device))))
    acc, new = _accept_sampled(logits, [0], q, sp, torch.Generator().manual_seed(0))
    assert acc == 0 and new == [1]                          # rejected; the residual is the target's only token
    # a token with p > 0 is still accepted at u = 0
    acc, new = _accept_sampled(logits, [1], torch.tensor([[0.0, 1.0, 0.0, 0.0]]), sp, torch.Generator())
    assert acc == 1 and new == [1, 3]
