"""The drafters' graph paths (runtime/drafter_graphs.py) propose and observe exactly what the eager paths do.

On CPU the same functions run eagerly (no capture), which checks their logic: the full-capacity masked context
attention, padded observe rows, the on-device selector walk and the host-side floor cut."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.drafters.dflash2.graphs import DFlash2Graphs
from runtime.engine import Engine
from runtime.sampling import SamplingParams
from tests.runtime.drafters.dflash2.helpers import drafter_config, one_thread, write_hf_drafter  # noqa: F401
from tests.runtime.tiny import make_tiny_target


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    target = make_tiny_target(root, vocab=64, hidden=32, layers=3, mtp=False)
    cfg = drafter_config(hidden=32, inter=64, vocab=64, heads=2, kv_heads=1, head_dim=16, taps=(0, 2),
                         num_target_layers=3, block_size=6, top_k=4, rank=16)
    return target, write_hf_drafter(root / "dflash2", cfg, seed=4), write_hf_drafter(root / "v1", cfg, seed=5, v1=True)


@pytest.mark.parametrize("which", [1, 2])
def test_dflash2_graph_path_equals_eager(setup, which):
    target, path = setup[0], setup[which]
    eng = Engine.build(target, "dflash2", drafter_path=path, device="cpu", context=96)
    ids = eng.tokenizer.encode("hello there, general kenobi").ids
    for min_p in (0.0, 0.2):
        ref = eng.generate(ids, max_new_tokens=30, spec_min_p=min_p, stop_ids=set())
        d = eng.drafter
        d.graphs = DFlash2Graphs(d)
        got = eng.generate(ids, max_new_tokens=30, spec_min_p=min_p, stop_ids=set())
        assert d.graphs.enabled and not d.graphs.errors
        assert got.token_ids == ref.token_ids
        assert got.stats["accepted"] == ref.stats["accepted"] and got.stats["windows"] == ref.stats["windows"]
        # each window drafted the next one before its read (docs/models.md, "Drafting ahead"), but for the last ones,
        # whose next window may be narrower than a block (the last 2 x block tokens at most)
        assert got.stats["windows"] - 2 * 6 <= got.stats["drafted_ahead"] < got.stats["windows"]
        assert ref.stats["drafted_ahead"] == 0
        # proposals and the draft context are the same as the eager path's at the end state
        k_eager = d.cache.k[:, :, : d.cache.length].clone()
        d.graphs = None
        eng.generate(ids, max_new_tokens=30, spec_min_p=min_p, stop_ids=set())
        assert torch.allclose(d.cache.k[:, :, : d.cache.length], k_eager, atol=1e-5)


def test_dflash2_graph_functions_make_no_host_reads(setup):
    """A CUDA graph cannot hold a host read (`.item()`, a 0-d tensor index, `nonzero`): on the meta device every
    such read raises, so running the captured functions there proves they have none."""
    target, path = setup[0], setup[1]
    eng = Engine.build(target, "dflash2", drafter_path=path, device="cpu", context=96)
    d = eng.drafter
    g = DFlash2Graphs(d)
    eng.model.to("meta")
    d.model.to("meta")
    d.cache.k, d.cache.v = d.cache.k.to("meta"), d.cache.v.to("meta")
    g.scal, g.obs_taps, g.dev = g.scal.to("meta"), g.obs_taps.to("meta"), torch.device("meta")
    g.floor, g.noise = g.floor.to("meta"), g.noise.to("meta")
    with torch.no_grad():
        toks, conf, keep, q = g._draft_cut(6)   # forward, selector walk and the floor cut: one graph
        g._observe()
        s_toks, s_conf, s_keep, s_q = g._draft_cut(6, SamplingParams(temperature=0.8, top_p=0.9))   # sampled
    assert toks.shape == (5,) and conf.shape == (5,) and keep.shape == () and q is None
    assert s_toks.shape == (5,) and s_q.shape == (5, 64) and s_keep.shape == ()


def _selector(V: int, k: int, r: int, seed: int, integer: bool):
    from runtime.drafters.dflash2.contract import DFlash2Geometry
    from runtime.drafters.dflash2.model import CandidateSelector
    from tests.runtime.drafters.dflash2.helpers import drafter_config

    geom = DFlash2Geometry.from_config(drafter_config(hidden=16, vocab=V, top_k=k, rank=r))
    sel = CandidateSelector(geom)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sel.parameters():
            v = torch.randn(p.shape, generator=g)
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float() if integer else v)
    return sel, g


@pytest.mark.parametrize("seed", range(6))
def test_lattice_walk_picks_what_the_sequential_walk_picks(seed):
    """The lattice formulation (all predecessor x candidate scores at once, then a chain of gathers) picks exactly
    the sequential walk's tokens with its confidences: random scores, and small integers where every score is exact
    and ties are everywhere (both take the first candidate among equals)."""
    from runtime.drafters.dflash2.model import lattice_walk, select_walk

    integer = seed % 2 == 1
    sel, g = _selector(V=40, k=5, r=8, seed=seed, integer=integer)
    R = 7
    hs = torch.randint(-1, 2, (R, 16), generator=g).float() if integer else torch.randn(R, 16, generator=g)
    logits = torch.randint(0, 3, (R, 40), generator=g).float() if integer else torch.randn(R, 40, generator=g)
    anchor = int(torch.randint(0, 40, (1,), generator=g))
    ref = select_walk(sel, hs, logits, anchor)
    toks, conf = lattice_walk(sel, hs, logits, torch.tensor([anchor]))
    assert torch.equal(toks, ref.tokens)
    assert torch.allclose(conf, ref.confidence, rtol=1e-6, atol=1e-7)
    if integer:   # exact arithmetic: the same bits
        assert torch.equal(conf, ref.confidence)


def test_lattice_walk_ties_take_the_first_candidate():
    """All-zero codebooks and equal logits: every score ties; both walks take candidate 0 of every row."""
    from runtime.drafters.dflash2.model import lattice_walk, select_walk

    sel, _ = _selector(V=12, k=4, r=4, seed=0, integer=True)
    with torch.no_grad():
        sel.predecessor_codebook.zero_()
    logits = torch.zeros(5, 12)
    hs = torch.ones(5, 16)
    ref = select_walk(sel, hs, logits, 3)
    toks, conf = lattice_walk(sel, hs, logits, torch.tensor([3]))
    cand0 = torch.topk(logits, 4, dim=-1).indices[:, 0]
    assert torch.equal(ref.tokens, cand0) and torch.equal(toks, cand0)
    assert torch.equal(conf, ref.confidence) and torch.allclose(conf, torch.full((5,), 0.25))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_dflash2_fast_graph_path_in_interpreter():
    """The fused fast path (Triton kernels under TRITON_INTERPRET=1) decodes, accepts, observes and proposes as the
    eager path does: tests/runtime/kernels_check.py dflash2."""
    script = Path(__file__).resolve().parents[2] / "kernels_check.py"
    r = subprocess.run([sys.executable, str(script), "dflash2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "dflash2 graphs ok" in r.stdout, r.stderr[-2000:]


def test_graph_sampled_walk_draws_the_selector_chain(setup):
    """The graph path's sampled walk (Gumbel-max over each row's candidates, for every predecessor at once, then
    the chain) draws (row 0, row 1) from the selector's own chain: softmax(score[0 | anchor] / T), then
    softmax(score[1 | drawn row 0] / T); chi-square over the k x k pairs, flat enough scores that a wrong draw
    shows. Its q rows are the walked rows' softmax(score / T) over the candidates."""
    from tests.runtime.test_speculative_sampling import chi2_pvalue

    target, path = setup[0], setup[1]
    eng = Engine.build(target, "dflash2", drafter_path=path, device="cpu", context=96)
    g = DFlash2Graphs(eng.drafter)
    sel = eng.drafter.model.candidate_selector
    gen = torch.Generator().manual_seed(5)
    R, V, k, T = 2, 64, sel.top_k, 1.3
    hs = torch.randn(R, 32, generator=gen)
    logits = torch.randn(R, V, generator=gen)
    anchor = torch.tensor([7])
    unary, cand = torch.topk(logits, k, dim=-1)
    hp = sel.hidden_projection(hs).float()

    def row(r, prev):
        return unary[r] + sel.successor_codebook[cand[r]].float() @ (sel.predecessor_codebook[prev].float() * hp[r])

    with torch.no_grad():
        p0 = torch.softmax(row(0, 7) / T, -1)
        exact = torch.stack([p0[i] * torch.softmax(row(1, int(cand[0, i])) / T, -1) for i in range(k)])
        counts = torch.zeros(k, k)
        sp = SamplingParams(temperature=T)
        for _ in range(4000):
            g.noise.uniform_(generator=gen)
            toks, conf, q = g._select_sampled(hs, logits, anchor, sp)
            i = int((cand[0] == toks[0]).nonzero()[0, 0])
            j = int((cand[1] == toks[1]).nonzero()[0, 0])
            counts[i, j] += 1
        assert chi2_pvalue(counts.flatten(), exact.flatten()) > 1e-3
        torch.testing.assert_close(q[0, cand[0]], p0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(q[1, cand[1]], torch.softmax(row(1, int(toks[0])) / T, -1), rtol=1e-5, atol=1e-6)
