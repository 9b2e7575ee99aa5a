"""End to end: speculative decoding with DFlash2 drafters (HF BF16, GGUF BF16/Q8_0/Q5_0/Q4_0, v1) is lossless.

Random drafters exercise rejections everywhere; a drafter fitted to the target's own greedy continuation (through
the training forward) exercises long accepted runs.
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine
from runtime.sampling import SamplingParams
from tests.runtime.drafters.dflash2.helpers import (
    drafter_config,
    one_thread,  # noqa: F401  (autouse fixture)
    train_on_sequence,
    write_gguf_drafter,
    write_hf_drafter,
)
from tests.runtime.tiny import make_tiny_target

PROMPTS = ["hello world", "the quick brown fox"]
N_NEW = 20


def _drafter_cfg(**kw):
    return drafter_config(hidden=32, inter=64, vocab=64, heads=2, kv_heads=1, head_dim=16, taps=(0, 2),
                          num_target_layers=3, block_size=8, top_k=4, rank=16, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    target = make_tiny_target(root, vocab=64, hidden=32, layers=3, mtp=False)
    hf = write_hf_drafter(root / "dflash2", _drafter_cfg(), seed=4)
    arts = {"hf": hf}
    for q in ("bf16", "q8_0", "q5_0", "q4_0"):
        arts[q] = write_gguf_drafter(root / f"dflash2-{q}.gguf", hf, quant=q)
    arts["v1"] = write_hf_drafter(root / "dflash-v1", _drafter_cfg(), seed=5, v1=True)
    base = Engine.build(target, "none", device="cpu", context=128)
    ref = {p: base.generate(p, max_new_tokens=N_NEW).token_ids for p in PROMPTS}
    return root, target, arts, ref, base


GRID = {"hf": ((2, 5, 8), (0.0, 0.4, 0.9)), "v1": ((3, 8), (0.0, 0.5))}


@pytest.mark.parametrize("art", ["hf", "bf16", "q8_0", "q5_0", "q4_0", "v1"])
def test_greedy_speculative_equals_target_only(setup, art):
    _root, target, arts, ref, _ = setup
    eng = Engine.build(target, "dflash2", drafter_path=arts[art], device="cpu", context=128)
    assert eng.drafter.kind == "dflash2"
    blocks, floors = GRID.get(art, ((4, 8), (0.0, 0.6)))
    proposed = 0
    for prompt in PROMPTS:
        for block in blocks:
            for min_p in floors:
                res = eng.generate(prompt, max_new_tokens=N_NEW, block=block, spec_min_p=min_p)
                assert res.token_ids == ref[prompt], (prompt, block, min_p)
                proposed += res.stats["proposed"]
    assert proposed > 0
    mem = eng.memory_report()
    assert mem["drafter_kv"] == 2 * 2 * 1 * 16 * 4 * 128 and mem["drafter_weights"] > 0


@pytest.fixture(scope="module")
def trained(setup):
    """A drafter fitted to the target's greedy continuation of one prompt, as HF BF16 and GGUF Q8_0: trained
    until its BF16 weights, walking the continuation greedily in the training forward, accept 5 proposals a
    window (with a score margin), so the long-run property below does not hang on how far a fixed number of steps
    gets on this CPU. The test then asserts the runs through the real loop (inference path, BF16 and Q8_0)."""
    root, target, _arts, _ref, base = setup
    ids = base.tokenizer.encode(PROMPTS[1]).ids
    W = _drafter_cfg()["dflash_config"]["block_size"]
    longer = base.generate(ids, max_new_tokens=40 + W).token_ids     # every window of a 40-token run is whole
    out = longer[:40]
    state = train_on_sequence(_drafter_cfg(), base.model, torch.tensor(ids + longer), first_anchor=len(ids) - 1,
                              until_runs=5.0, walk_from=len(ids))
    hf = write_hf_drafter(root / "trained", _drafter_cfg(), state)
    return ids, out, {"hf": hf, "q8_0": write_gguf_drafter(root / "trained-q8_0.gguf", hf, quant="q8_0")}


@pytest.mark.parametrize("art", ["hf", "q8_0"])
def test_long_accepted_runs_stay_lossless(setup, trained, art):
    target = setup[1]
    ids, out, arts = trained
    eng = Engine.build(target, "dflash2", drafter_path=arts[art], device="cpu", context=128)
    for block, min_p in ((8, 0.0), (8, 0.5), (6, 0.0), (3, 0.2)):
        res = eng.generate(ids, max_new_tokens=40, block=block, spec_min_p=min_p)
        assert res.token_ids == out, (block, min_p)
        if block == 8 and min_p == 0.0:
            acc = res.stats["accepted_per_window"]
            assert sum(acc) / len(acc) >= 4, acc          # long runs of accepted proposals really happen


def test_sampled_speculative_is_seeded(setup):
    _root, target, arts, _ref, _ = setup
    eng = Engine.build(target, "dflash2", drafter_path=arts["q8_0"], device="cpu", context=128)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    a = eng.generate(PROMPTS[0], max_new_tokens=N_NEW, sampling=sp)
    b = eng.generate(PROMPTS[0], max_new_tokens=N_NEW, sampling=sp)
    assert a.token_ids == b.token_ids and a.stats["proposed"] > 0


def test_an_unconfigured_floor_is_the_kinds_default_and_an_explicit_zero_wins(setup):
    """No floor in the config: a DFlash2 run uses 0.5 (the kind table's uncalibrated default) and its head's own
    block size; `spec_min_p = 0` stays 0."""
    from runtime.drafters.registry import KINDS

    _root, target, arts, _ref, _ = setup
    eng = Engine.build(target, "dflash2", drafter_path=arts["hf"], device="cpu", context=64)
    assert eng.spec_min_p == KINDS["dflash2"].default_spec_min_p == 0.5
    assert eng.block == 8                                      # the head's block_size
    res = eng.generate(PROMPTS[0], max_new_tokens=4)
    assert res.stats["spec_min_p"] == 0.5
    zero = Engine.build(target, "dflash2", drafter_path=arts["hf"], device="cpu", context=64, spec_min_p=0.0)
    assert zero.spec_min_p == 0.0
    doc = {"schema": 1, "target": {"path": str(target)}, "drafter": {"kind": "dflash2", "path": str(arts["hf"])},
           "memory": {"context": 64}, "device": {"type": "cpu"}}
    assert Engine.from_config(doc).spec_min_p == 0.5
    doc["speculative"] = {"spec_min_p": 0.0}
    assert Engine.from_config(doc).spec_min_p == 0.0
