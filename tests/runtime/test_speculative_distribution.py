"""Sampled speculative decoding end to end follows target-only sampling, with the floor on and top-k/top-p.

The real loop (`generate_ids` through the CPU engine's fixed-width step) with the real drafters (MTP; a DFlash2
head loaded from its folder), temperature 0.9, top-k 6, top-p 0.95, a confidence floor that cuts windows short,
4 new tokens after a fixed prompt, on a target with 8 tokens so the exact distribution of target-only sampling is
enumerated (8^4 continuations). Checks, each a Pearson chi-square at significance 1e-3 (cells with an expected
count under 5 pooled): the marginals of tokens 2, 3, 4 and the pairs (2, 3) and (3, 4); token 1 comes from the
prompt alone. 1000 runs per drafter with seeds 0..999, so the outcome is fixed (it cannot flake). Power: the same
test on a DFlash2 walk that keeps the unrestricted q under the floor (the bias `_floor_q` exists to remove) fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import runtime.drafters.dflash2.model as dflash2_model
from runtime.drafters.dflash2.loading import load_dflash2_drafter
from runtime.drafters.mtp import MTPDrafter
from runtime.gpu.static_step import StaticStep
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.sampling import SamplingParams, probs
from runtime.speculative import generate_ids
from tests.runtime.drafters.dflash2.helpers import drafter_config, write_hf_drafter
from tests.runtime.test_speculative_sampling import chi2_pvalue
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
V, DEPTH, RUNS, ALPHA = 8, 4, 1000, 1e-3
PROMPT = [2, 5, 3, 7, 6]
SP = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
FLOOR = {"mtp": 0.6, "dflash2": 0.5}


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    return make_target_and_head(tmp_path_factory.mktemp("dist"))


def make_target_and_head(root):
    """The 8-token target, a random DFlash2 head for it, and the exact joint of 4 sampled tokens after PROMPT."""
    model = load_target(make_tiny_target(root, vocab=V, seed=5, scale=3.0))
    head = write_hf_drafter(root / "dflash2", drafter_config(hidden=32, inter=64, vocab=V, heads=2, kv_heads=1,
                                                             head_dim=16, taps=(0, 2), num_target_layers=3,
                                                             block_size=4, top_k=4, rank=8), seed=3)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=DEPTH)))
    ids = torch.cat([torch.tensor(PROMPT).expand(seqs.shape[0], -1), seqs], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1: -1]
    joint = probs(logits, SP).gather(-1, seqs[..., None])[..., 0].prod(-1).view((V,) * DEPTH)
    return model, head, joint


class Recording:
    """A drafter wrapper that notes how many proposals each window asked for and got."""

    def __init__(self, inner) -> None:
        self.inner, self.asked, self.got = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, anchor, pos, n, **kw):
        prop = self.inner.propose(anchor, pos, n, **kw)
        self.asked, self.got = self.asked + n, self.got + len(prop.tokens)
        return prop


def sample(model, drafter, floor: float, scale: float = 1.0):
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32)
    step = StaticStep(model, kv, drafter.max_block, graph=False)
    rec = Recording(drafter)
    counts = torch.zeros((V,) * DEPTH, dtype=torch.long)
    proposed = accepted = 0
    for seed in range(RUNS):
        sp = SamplingParams(SP.temperature, SP.top_p, SP.top_k, seed=seed)
        r = generate_ids(model, kv, PROMPT, drafter=rec, block=4, sampling=sp, spec_min_p=floor,
                         max_new_tokens=DEPTH, step=step, draft_temp_scale=scale)
        counts[tuple(r.token_ids)] += 1
        proposed += r.stats["proposed"]
        accepted += r.stats["accepted"]
    return counts, proposed, accepted, rec


def pvalues(counts, joint) -> list[float]:
    def marginal(t, keep):
        return t.sum(tuple(i for i in range(DEPTH) if i not in keep)).flatten()

    checks = [(1,), (2,), (3,), (1, 2), (2, 3)]
    return [chi2_pvalue(marginal(counts, k), marginal(joint, k)) for k in checks]


def drafter_for(kind, model, head):
    if kind == "mtp":
        return MTPDrafter(model, 32, max_block=4)
    return load_dflash2_drafter(head, model, context=32)


@pytest.mark.parametrize("kind, scale", [("mtp", 1.0), ("dflash2", 1.0), ("mtp", 1.7), ("dflash2", 1.7)])
def test_sampled_output_follows_target_only_sampling(target_and_head, kind, scale):
    """Also with the drafter drawing hotter than the target (`draft_temp_scale`): its q is what it drew from."""
    model, head, joint = target_and_head
    counts, proposed, accepted, rec = sample(model, drafter_for(kind, model, head), FLOOR[kind], scale)
    assert 0 < accepted < proposed                   # acceptances and rejections both happened
    assert 0 < rec.got < rec.asked                   # the floor cut windows short (and let proposals through)
    ps = pvalues(counts, joint)
    assert min(ps) > ALPHA, ps


class WrongQ(Recording):
    """Draws hotter (as `draft_temp_scale` asks) but reports q at the request's temperature: the bias the loop
    avoids by accepting against what the proposals were drawn from."""

    def propose(self, anchor, pos, n, **kw):
        prop = self.inner.propose(anchor, pos, n, **kw)
        if prop.q is not None:
            q = prop.q.clamp_min(0) ** 1.7          # q at T * 1.7 raised back to T (the same support)
            prop.q = q / q.sum(-1, keepdim=True)
        return prop


def test_the_check_has_power_against_a_q_other_than_the_draws(target_and_head):
    model, head, joint = target_and_head
    counts, _, _, _ = sample(model, WrongQ(drafter_for("mtp", model, head)), FLOOR["mtp"], 1.7)
    assert min(pvalues(counts, joint)) < ALPHA


def test_the_check_has_power_against_an_unrestricted_q_under_the_floor(target_and_head, monkeypatch):
    """Accepting against the unrestricted q when the floor decides which rows survive biases the output; the
    same chi-square checks at the same significance catch it."""
    model, head, joint = target_and_head
    monkeypatch.setattr(dflash2_model, "_floor_q", lambda q, passes: q)
    counts, _, _, _ = sample(model, drafter_for("dflash2", model, head), FLOOR["dflash2"])
    assert min(pvalues(counts, joint)) < ALPHA
