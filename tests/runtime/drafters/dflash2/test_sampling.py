"""Sampled speculative decoding with a DFlash2 drafter is lossless: the marginals of the 2nd and 3rd generated
tokens match the exact target-only marginals (computed by enumerating every prefix), chi-square at p < 1e-4 with
fixed seeds. The drafter is fitted to the target so that about half of its proposals are accepted: both the accept
path and the residual-resample path run."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.engine import Engine
from runtime.sampling import SamplingParams
from tests.runtime.drafters.dflash2.helpers import (
    drafter_config,
    one_thread,  # noqa: F401  (autouse fixture)
    train_on_sequence,
    write_hf_drafter,
)
from tests.runtime.tiny import make_tiny_target

T = 0.12          # peaked target distributions, so the fitted drafter is often right
N = 240
V = 64


def _chi2_crit(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.719: p = 1e-4)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _chi2(obs: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    e = p * obs.sum()
    big = e >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([e[big], e[~big].sum()[None]])
    return float(((o - e) ** 2 / e).sum()), int(big.sum())


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True])
def test_sampled_dflash2_is_lossless(tmp_path, graphs):
    """graphs=True: the graph path's functions (run eagerly on the CPU): the Gumbel-max lattice walk."""
    target = make_tiny_target(tmp_path, vocab=V, hidden=32, layers=3, mtp=False)
    base = Engine.build(target, "none", device="cpu", context=64)
    ids = base.tokenizer.encode("hello").ids
    greedy = base.generate(ids, max_new_tokens=30, stop_ids=set()).token_ids
    cfg = drafter_config(hidden=32, inter=64, vocab=V, heads=2, kv_heads=1, head_dim=16, taps=(0, 2),
                         num_target_layers=3, block_size=8, top_k=4, rank=16)
    state = train_on_sequence(cfg, base.model, torch.tensor(ids + greedy), first_anchor=len(ids) - 1, width=3)
    eng = Engine.build(target, "dflash2", drafter_path=write_hf_drafter(tmp_path / "d", cfg, state),
                       device="cpu", context=64)
    if graphs:
        from runtime.drafters.dflash2.graphs import DFlash2Graphs

        eng.drafter.graphs = DFlash2Graphs(eng.drafter)
    m = eng.model
    with torch.no_grad():   # exact marginals of generated tokens 1 and 2 under target-only sampling at T
        p0 = torch.softmax(m(torch.tensor([ids])).logits[0, -1].float() / T, -1)
        p1 = torch.softmax(m(torch.tensor([ids + [a] for a in range(V)])).logits[:, -1].float() / T, -1)
        seq2 = torch.tensor([ids + [a, b] for a in range(V) for b in range(V)])
        p2 = torch.softmax(m(seq2).logits[:, -1].float() / T, -1).view(V, V, V)
    m1 = p0 @ p1
    m2 = torch.einsum("a,ab,abc->c", p0, p1, p2)
    c1, c2 = torch.zeros(V), torch.zeros(V)
    accepted = proposed = 0
    for seed in range(N):
        # block 3, 4 new tokens: the first window drafts 2 rows (the width the drafter was fitted at)
        r = eng.generate(ids, max_new_tokens=4, sampling=SamplingParams(temperature=T, seed=seed), block=3,
                         stop_ids=set())
        c1[r.token_ids[1]] += 1
        c2[r.token_ids[2]] += 1
        accepted += r.stats["accepted"]
        proposed += r.stats["proposed"]
    assert 0.2 * proposed < accepted < 0.9 * proposed, (accepted, proposed)
    if graphs:
        assert eng.drafter.graphs.enabled and not eng.drafter.graphs.errors
    for obs, exact in ((c1, m1), (c2, m2)):
        stat, df = _chi2(obs, exact)
        assert stat < _chi2_crit(max(df, 1)), (stat, df)
