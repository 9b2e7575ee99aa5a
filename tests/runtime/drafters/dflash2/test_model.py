"""DFlash2 model pieces against hand-computed cases (the whole drafter against z-lab's reference: test_reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.drafters.dflash2.model import ContextCache, DFlash2Model, GroupedDynamicCausalConv, select_walk
from tests.runtime.drafters.dflash2.helpers import (
    drafter_config,
    one_thread,  # noqa: F401  (autouse fixture)
    random_drafter_state,
)


def make_model(seed: int = 0, v1: bool = False, **kw) -> DFlash2Model:
    cfg = drafter_config(**kw)
    model = DFlash2Model(DFlash2Geometry.from_config(cfg), v1=v1)
    state = {k: v.float() for k, v in random_drafter_state(cfg, seed=seed, v1=v1).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def shared(vocab: int = 80, hidden: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(vocab, hidden)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=g))
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 4)
    return embed, head


# ------------------------------------------------------------------------------------------------ convolution

def naive_conv(h, dyn, base, G):
    """docs/models.md ("DFlash2 drafter", step 4), literally: out[t] = Σ_{o<K, t-o>=0} base[o]*h[t-o] + dyn[t,o] (per group) * h[t-o]."""
    B, W, H = h.shape
    K = base.shape[0]
    out = torch.zeros_like(h)
    for b in range(B):
        for t in range(W):
            for o in range(K):
                if t - o < 0:
                    continue            # row 0 reads zeros for offset 1: never across the block start
                out[b, t] += base[o] * h[b, t - o] + dyn[b, t, o].repeat_interleave(G) * h[b, t - o]
    return out


def test_conv_identity_base_and_zero_projection_is_identity():
    conv = GroupedDynamicCausalConv(64, 3, 16)
    with torch.no_grad():
        conv.base_kernel.zero_()
        conv.base_kernel[:, 0] = 1.0
        conv.kernel_projection.weight.zero_()
    h = torch.randn(2, 5, 64)
    y, d = conv.prepare(h)
    assert torch.equal(y, h)
    assert torch.equal(conv.finish(h, d), h)


@pytest.mark.parametrize("grad", [True, False])      # training's loop, inference's taps at once
@pytest.mark.parametrize("k, w", [(2, 6), (3, 6), (3, 1), (2, 2)])
def test_conv_matches_formula_and_never_crosses_the_block_start(grad, k, w):
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(64, k, 16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    h = torch.randn(3, w, 64)
    with torch.set_grad_enabled(grad):
        y, d = conv.prepare(h)
        fin = conv.finish(h, d)
        h2 = h.clone()
        h2[1] += 5.0
        y2, _ = conv.prepare(h2)
    with torch.no_grad():
        dyn = conv.kernel_projection(h).view(3, w, 2, k, 4)
        torch.testing.assert_close(y, naive_conv(h, dyn[:, :, 0], conv.base_kernel[0], 16), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fin, naive_conv(h, dyn[:, :, 1], conv.base_kernel[1], 16), rtol=1e-5, atol=1e-5)
    # row 0 of a window depends on row 0 only; windows in a batch never mix
    assert torch.equal(y2[0], y[0]) and torch.equal(y2[2], y[2])
    h3 = torch.cat([torch.randn(3, 1, 64), h], dim=1)       # a row before the block changes nothing in it
    with torch.set_grad_enabled(grad):
        y3, _ = conv.prepare(h3[:, 1:])
    assert torch.equal(y3, y)


# ------------------------------------------------------------------------------------------------ selector

def test_selector_top1_is_argmax():
    model = make_model(top_k=1)
    hs = torch.randn(7, 64)
    logits = torch.randn(7, 80)
    walk = select_walk(model.candidate_selector, hs, logits, anchor=3)
    assert walk.tokens.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(walk.confidence, torch.ones(7))


def test_greedy_walk_matches_hand_loop_and_min_p_truncates():
    model = make_model(top_k=5)
    sel = model.candidate_selector
    torch.manual_seed(3)
    hs, logits = torch.randn(7, 64), torch.randn(7, 80) * 2
    walk = select_walk(sel, hs, logits, anchor=11)
    P, S, Wp = (t.detach() for t in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight))
    prev, expect, conf = 11, [], []
    for r in range(7):
        hp = [sum(float(Wp[j, c]) * float(hs[r, c]) for c in range(64)) for j in range(Wp.shape[0])]
        order = sorted(range(80), key=lambda v: -float(logits[r, v]))[:5]
        scores = [float(logits[r, v]) + sum(float(P[prev, j]) * hp[j] * float(S[v, j]) for j in range(len(hp)))
                  for v in order]
        best = max(range(5), key=lambda i: scores[i])
        z = sum(math.exp(s - scores[best]) for s in scores)
        prev = order[best]
        expect.append(prev)
        conf.append(1.0 / z)
    assert walk.tokens.tolist() == expect
    torch.testing.assert_close(walk.confidence, torch.tensor(conf), rtol=1e-4, atol=1e-5)
    floor = sorted(conf)[2] + 1e-6            # some row falls under the floor: stop before the first one
    first_low = next(i for i, c in enumerate(conf) if c < floor)
    cut = select_walk(sel, hs, logits, anchor=11, min_p=floor)
    assert cut.tokens.tolist() == expect[:first_low]


def test_sampled_walk_keeps_q_over_candidates():
    model = make_model(top_k=4)
    hs, logits = torch.randn(5, 64), torch.randn(5, 80)
    g = torch.Generator().manual_seed(0)
    walk = select_walk(model.candidate_selector, hs, logits, anchor=2, temperature=0.7, generator=g)
    assert walk.q.shape == (5, 80)
    torch.testing.assert_close(walk.q.sum(-1), torch.ones(5))
    cand = torch.topk(logits, 4, dim=-1).indices
    for r in range(5):
        assert set(walk.q[r].nonzero()[:, 0].tolist()) <= set(cand[r].tolist())
        assert walk.q[r, walk.tokens[r]] > 0
    # teacher-forced training scores on the sampled path give the same rows: q = softmax(score / T)
    prev = torch.cat([torch.tensor([2]), walk.tokens[:-1]])
    scores, c2 = model.selector_scores(hs[None], logits[None], prev[None])
    assert torch.equal(c2[0], cand)
    q = torch.softmax(scores[0] / 0.7, dim=-1)
    torch.testing.assert_close(walk.q.gather(-1, cand), q, rtol=1e-5, atol=1e-6)
    g2 = torch.Generator().manual_seed(0)
    again = select_walk(model.candidate_selector, hs, logits, anchor=2, temperature=0.7, generator=g2)
    assert torch.equal(again.tokens, walk.tokens)


# ------------------------------------------------------------------------------------------------ whole forward

def test_training_forward_matches_inference_and_trains():
    model = make_model(layer_types=["sliding_attention", "sliding_attention"], sliding_window=6)
    embed, head = shared()
    S, W = 14, 5
    taps = torch.randn(S, 2 * 64)
    anchors = [3, 8, 12]
    ids = torch.full((3, W), model.geom.mask_token_id)
    ids[:, 0] = torch.tensor([40, 41, 42])
    positions = torch.stack([torch.arange(a, a + W) for a in anchors])
    # one shared context of all S positions, each window sees positions < its anchor
    out = model(taps[None], torch.arange(S), ids, positions, embed=embed, lm_head=head,
                ctx_lengths=torch.tensor(anchors))
    assert out.logits.shape == (3, W - 1, 80) and out.hs.shape == (3, W - 1, 64)
    for b, a in enumerate(anchors):
        cache = ContextCache(model, 32)
        cache.append(model, taps[:a], 0)
        hs = model.draft_hidden(int(ids[b, 0]), a, W, cache, embed)
        torch.testing.assert_close(out.hs[b], hs, rtol=1e-5, atol=1e-5)
        # the head sums 64 products of hidden values that agree to 1e-5 (two summation orders): 1e-5 on the logits
        # was too tight (1.5e-5 seen once); from the same rows its output is the same up to rounding
        torch.testing.assert_close(out.logits[b], model.compute_logits(hs, head), rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(out.logits[b], model.compute_logits(out.hs[b], head), rtol=1e-6, atol=1e-6)
    # per-window contexts with a key padding mask give the same result
    ctx = torch.zeros(3, S, 2 * 64)
    mask = torch.zeros(3, S, dtype=torch.bool)
    for b, a in enumerate(anchors):
        ctx[b, :a], mask[b, :a] = taps[:a], True
    out2 = model(ctx, torch.arange(S), ids, positions, embed=embed, lm_head=head, ctx_mask=mask)
    torch.testing.assert_close(out2.logits, out.logits, rtol=1e-5, atol=1e-5)
    # two sequences, windows pointing at their sequence with ctx_index (context K/V computed once per sequence)
    seqs = torch.stack([torch.randn(S, 2 * 64), taps])
    out3 = model(seqs, torch.arange(S), ids, positions, embed=embed, lm_head=head,
                 ctx_lengths=torch.tensor(anchors), ctx_index=torch.tensor([1, 0, 1]))
    torch.testing.assert_close(out3.logits[[0, 2]], out.logits[[0, 2]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out3.logits[1], out.logits[1])
    # autograd: a loss on logits + selector scores reaches every kind of parameter
    model.train()
    out = model(taps[None], torch.arange(S), ids, positions, embed=embed, lm_head=head,
                ctx_lengths=torch.tensor(anchors))
    prev = torch.cat([ids[:, :1], torch.randint(0, 80, (3, W - 2))], dim=1)
    scores, _ = model.selector_scores(out.hs, out.logits, prev)
    loss = out.logits.logsumexp(-1).mean() + scores.logsumexp(-1).mean()
    loss.backward()
    for name in ("fc.weight", "layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook", "layers.0.self_attn.k_norm.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_v1_model_is_v2_with_identity_conv_and_top1_selector():
    v1 = make_model(v1=True)
    v2 = make_model(top_k=1)
    state = v1.state_dict()
    with torch.no_grad():
        for k, v in v2.state_dict().items():
            if k in state:
                v.copy_(state[k])
            elif k.endswith("base_kernel"):
                v.zero_()
                v[:, 0] = 1.0
            elif "kernel_projection" in k:
                v.zero_()
    embed, head = shared()
    taps = torch.randn(6, 128)
    outs = []
    for m in (v1, v2):
        cache = ContextCache(m, 16)
        cache.append(m, taps, 0)
        outs.append(m.compute_logits(m.draft_hidden(5, 6, 8, cache, embed), head))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_sampled_walk_draws_from_its_q():
    """Chi-square (fixed seed): row 0 tokens follow q[0]; row 1 tokens follow the q[1] each walk reported."""
    model = make_model(top_k=4)
    torch.manual_seed(5)
    hs, logits = torch.randn(2, 64), torch.randn(2, 80)
    g = torch.Generator().manual_seed(123)
    N = 2000
    cnt0, cnt1, exp1 = torch.zeros(80), torch.zeros(80), torch.zeros(80)
    q0 = None
    for _ in range(N):
        w = select_walk(model.candidate_selector, hs, logits, anchor=9, temperature=1.3, generator=g)
        q0 = w.q[0] if q0 is None else q0
        assert torch.equal(w.q[0], q0)
        cnt0[w.tokens[0]] += 1
        cnt1[w.tokens[1]] += 1
        exp1 += w.q[1]
    for obs, exp in ((cnt0, q0 * N), (cnt1, exp1)):
        keep = exp > 0
        assert float(obs[~keep].sum()) == 0.0
        chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        assert chi2 < 21.1, chi2          # df <= 3: p < 1e-4
