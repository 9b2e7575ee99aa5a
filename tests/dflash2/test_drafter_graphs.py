"""The drafters' graph paths (runtime/drafter_graphs.py) propose and observe exactly what the eager paths do.

On CPU the same functions run eagerly (no capture), which checks their logic: the full-capacity masked context
attention, padded observe rows, the on-device selector walk and the host-side floor cut."""

from __future__ import annotations

import pytest
import torch

from runtime.drafter_graphs import DFlash2Graphs
from runtime.engine import Engine
from tests.dflash2.dflash2_helpers import drafter_config, one_thread, write_hf_drafter  # noqa: F401
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
    with torch.no_grad():
        toks, conf = g._draft(6)
        g._observe()
    assert toks.shape == (5,) and conf.shape == (5,)
