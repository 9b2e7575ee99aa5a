"""The target's CPU step compiled ahead of time (runtime/target_compiled.py): it computes the eager step's logits
within fp32 rounding, keeps a row's bits whatever the window around it (padding, window position, a chunk boundary),
so greedy speculative output equals the target alone at the engine's width, and every way it can be missing,
unfit or wrong leaves the eager step serving with a reason."""

import json
import shutil
import weakref

import pytest
import torch

from bench.common import NANO, NANO_DFLASH2, task_prompts
from runtime import aoti, cpu_ops, target_compiled
from runtime.engine import Engine
from runtime.gpu.static_step import StaticStep
from runtime.models.target_config import TargetGeometry
from tests.runtime.tiny import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A CPU engine with the pack's DFlash2 drafter (it taps three target layers) and both target packages built
    once into a store of its own."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the compiled step cannot be built here (the eager step serves)")
    mp = pytest.MonkeyPatch()
    mp.setenv("STRATA_COMPILE", "1")
    home = tmp_path_factory.mktemp("home")
    mp.setenv("STRATA_HOME", str(home))
    torch.set_num_threads(1)
    eng = Engine.build(NANO, "dflash2", drafter_path=NANO_DFLASH2, device="cpu", context=512, block=4)
    assert eng.target_taps == (1, 3, 5)
    assert eng.target_why == "not built for this machine yet (strata-setup builds it)"
    assert eng.compile_target(build=True) == ""
    assert sorted(eng.target_packages) == ["one", "wide"]
    # both packages call the attention and experts ops (runtime/cpu_ops.py), built into the same store
    assert len(list((home / "compiled").glob("cpu-ops-*.so"))) == 1
    assert target_compiled.shape_of(eng.model, eng.kv, "wide", eng.target_taps)["attn"] == "op"
    assert target_compiled.shape_of(eng.model, eng.kv, "one", eng.target_taps)["attn"] == "op"
    assert {target_compiled.shape_of(eng.model, eng.kv, m, eng.target_taps)["moe"] for m in ("one", "wide")} == {"op"}
    # ... and multiply by bf16 copies of the weights (the pack's checkpoint is bf16: the same values)
    assert {target_compiled.shape_of(eng.model, eng.kv, m, eng.target_taps)["w16"] for m in ("one", "wide")} == {True}
    assert eng.attention_why == ""
    yield eng, home / "compiled"
    mp.undo()


def _logits(step, kv, ids: list[int], start: int) -> torch.Tensor:
    kv.length = start
    return step(torch.tensor([ids]), kv).logits[0].clone()


def test_the_bf16_copies_hold_the_weights_values_and_are_counted(built):
    eng, _ = built
    copies = target_compiled._copies(eng.model)
    heads, layers = target_compiled._matrices(eng.model)
    def unblock(b):
        return cpu_ops.unblocks16(b).float()

    assert torch.equal(unblock(copies["head"]), heads[0])
    for (q, o, g, d), (wq, wo, wg, wd) in zip(copies["layers"], layers, strict=True):
        assert torch.equal(unblock(q), wq) and torch.equal(unblock(o), wo)
        assert torch.equal(g.float(), wg) and torch.equal(d.float(), wd)
    geo = TargetGeometry.from_config(json.loads((NANO / "config.json").read_text()))
    assert target_compiled.copies_nbytes(eng.model) == target_compiled.copies_bytes_for(geo) > 0
    assert eng.memory_report()["target_dense_weights"] > target_compiled.copies_nbytes(eng.model)


def test_a_weight_that_is_not_a_bf16_value_keeps_the_fp32_products(built, monkeypatch):
    eng, _ = built
    monkeypatch.setattr(target_compiled, "_COPIES", weakref.WeakKeyDictionary())
    w = eng.model.model.layers[2].self_attn.o_proj.weight
    kept = w.detach().clone()
    try:
        with torch.no_grad():
            w[0, 0] += 2.0 ** -20 * (1 + float(w[0, 0].abs()))       # no longer a bf16 value
        assert target_compiled._copies(eng.model) is None
        assert target_compiled.shape_of(eng.model, eng.kv, "one", ())["w16"] is False
    finally:
        with torch.no_grad():
            w.copy_(kept)


def test_logits_match_the_eager_step(built):
    eng, _ = built
    ids = eng.encode(task_prompts()["code"])
    eng.generate(ids, max_new_tokens=1, draft=False, width=1)       # the prompt's K/V in the cache
    start = len(ids) - 4
    for w in (1, 4):
        comp = eng.static_step(w)
        assert isinstance(comp, target_compiled.CompiledTargetStep)
        eager = StaticStep(eng.model, eng.kv, w, graph=False)
        win = ids[start:start + w]
        want, got = _logits(eager, eng.kv, win, start), _logits(comp, eng.kv, win, start)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_rows_bits_do_not_depend_on_its_window(built):
    """Padding after a row and the row's place in the window leave its logits' bits alone, also when the window
    crosses a 128-position chunk boundary (positions 126..129) and when the row alone reads one more chunk of keys
    than the window did (a window at 252 reads keys 0..255; row 1 alone at 253, with its padding, reads 0..383)."""
    eng, _ = built
    gen = torch.Generator().manual_seed(5)
    toks = torch.randint(0, eng.model.cfg.vocab_size, (270,), generator=gen).tolist()
    eng.generate(toks[:252], max_new_tokens=1, draft=False, width=4)
    step = eng.static_step(4)
    for start in (100, 126, 252):
        full = _logits(step, eng.kv, toks[start:start + 4], start)           # writes rows start..start+3
        for j in range(4):
            alone = _logits(step, eng.kv, [toks[start + j]], start + j)       # one real row, three padding rows
            assert torch.equal(alone[0], full[j]), (start, j)
        part = _logits(step, eng.kv, toks[start:start + 2], start)           # two real rows, two padding
        assert torch.equal(part, full[:2])


def test_greedy_speculation_equals_the_target_alone_at_the_width(built):
    eng, _ = built
    p = task_prompts()["math"]
    alone = eng.generate(p, max_new_tokens=48, draft=False, width=4)
    spec = eng.generate(p, max_new_tokens=48, draft=True, width=4)
    assert alone.stats["target_compiled"] and spec.stats["target_compiled"]
    assert spec.stats["accepted"] > 0
    assert spec.token_ids == alone.token_ids


def test_taps_are_the_tapped_layers_outputs(built):
    """The drafter's taps come out of the package: each tapped layer's output, next to the eager step's."""
    eng, _ = built
    ids = eng.encode(task_prompts()["code"])[:40]
    eng.generate(ids, max_new_tokens=1, draft=False, width=4)
    taps = eng.target_taps
    comp, eager = eng.static_step(4), StaticStep(eng.model, eng.kv, 4, graph=False)
    outs = []
    for step in (comp, eager):
        eng.kv.length = 36
        outs.append(step(torch.tensor([ids[36:40]]), eng.kv, taps).taps[0].clone())
    H = eng.model.cfg.hidden_size
    assert outs[0].shape == (4, len(taps) * H)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-4 * float(outs[1].abs().max()))
    assert comp.accepts(4, taps) and comp.accepts(4, ()) and not comp.accepts(4, (0,)) and not comp.accepts(5, ())


def test_switched_off_or_recording_runs_the_eager_step(built, monkeypatch):
    eng, _ = built
    eng.record_routing(True)
    try:
        assert target_compiled.fits(eng.model, eng.kv) == "routing is being recorded"
        assert isinstance(eng.static_step(4), StaticStep)
    finally:
        eng.record_routing(False)
    assert isinstance(eng.static_step(4), target_compiled.CompiledTargetStep)
    monkeypatch.setattr(aoti, "ENABLED", False)
    try:
        assert eng.compile_target(build=False) == "switched off (STRATA_COMPILE=0)"
        r = eng.generate("def f(x):", max_new_tokens=4, draft=False)
        assert r.stats["target_compiled"] is False
    finally:
        monkeypatch.setattr(aoti, "ENABLED", True)
        assert eng.compile_target(build=False) == ""


def test_a_foreign_or_damaged_package_is_refused_with_a_reason(built, tmp_path):
    eng, root = built
    taps = eng.target_taps
    other = Engine.build(NANO, "none", device="cpu", context=1024)      # another cache size: another package name
    assert target_compiled.key(other.model, other.kv, "one", taps) != target_compiled.key(eng.model, eng.kv, "one",
                                                                                          taps)
    shutil.copy(target_compiled.package_path(eng.model, eng.kv, "one", taps, root),
                target_compiled.package_path(other.model, other.kv, "one", taps, tmp_path))
    ld, why = target_compiled.load(other.model, other.kv, "one", taps, tmp_path)
    assert ld is None and why.startswith("the package target-step-one-") and "does not compute the target step" in why
    target_compiled.package_path(other.model, other.kv, "one", taps, tmp_path).write_bytes(b"not a package")
    ld, why = target_compiled.load(other.model, other.kv, "one", taps, tmp_path)
    assert ld is None and "would not load" in why
    assert list(tmp_path.glob(".*tmp*")) == []


def test_a_quantized_or_unspared_cache_does_not_fit(built):
    eng, _ = built
    q = Engine.build(NANO, "none", device="cpu", context=256, kv_dtype="q8_0")
    assert target_compiled.fits(q.model, q.kv) == "the KV cache is quantized"
    short = Engine.build(NANO, "none", device="cpu", context=64)
    assert target_compiled.fits(short.model, short.kv) == "the context is under 128 tokens"
    assert short.target_why == "the context is under 128 tokens"
    from runtime.kv import KVCache

    cfg = eng.model.cfg
    bare = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 256)
    assert target_compiled.fits(eng.model, bare) == "the KV cache has no room past its end for the compiled step"


def test_spare_slots_cover_every_window():
    for cap in (2, 127, 128, 129, 4096, 4097):
        s = target_compiled.spare_slots(cap)
        last_end = -(-(cap - 1 + target_compiled.WIDE_MAX) // target_compiled.CHUNK) * target_compiled.CHUNK
        assert cap + s >= last_end + target_compiled.CHUNK and s < 3 * target_compiled.CHUNK


def test_a_missing_package_is_built_at_the_first_run_or_the_reason_kept(built, tmp_path, monkeypatch):
    """A config set up without calibration has no packages: strata-run and strata-serve build them first
    (`compile_missing`), saying so; a failing build leaves the eager step and says why, with nothing left in the
    store."""
    eng, _ = built
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    assert eng.compile_target(build=False) == "not built for this machine yet (strata-setup builds it)"

    def fails(*a, **k):
        raise RuntimeError("C++ compile error")
    monkeypatch.setattr(target_compiled, "build", fails)
    said: list[str] = []
    eng.compiled_why = ""
    eng.compile_missing(said.append)
    assert len(said) == 1 and said[0].startswith("compiling the target's step for this CPU")
    assert eng.target_why == "compiling the one-row step failed (RuntimeError: C++ compile error)"
    assert isinstance(eng.static_step(4), StaticStep)
    left = list((tmp_path / "compiled").iterdir()) if (tmp_path / "compiled").exists() else []
    assert [p.name for p in left if not p.name.startswith("cpu-ops-")] == []     # no package, no temporary
    monkeypatch.undo()
    assert eng.compile_target(build=False) == ""


def test_windows_at_the_end_of_the_context_run(built):
    """The last positions of the cache: a one-row step at capacity - 1 and a 4-row window ending at the capacity
    run through the packages (the exporter's ranges cover every start)."""
    eng, _ = built
    cap = eng.kv.capacity
    gen = torch.Generator().manual_seed(9)
    toks = torch.randint(0, eng.model.cfg.vocab_size, (cap,), generator=gen).tolist()
    eng.generate(toks[:cap - 4], max_new_tokens=1, draft=False, width=4)
    for w, start in ((4, cap - 4), (1, cap - 1)):
        eng.kv.length = start
        out = eng.static_step(w)(torch.tensor([toks[start:start + w]]), eng.kv)
        assert out.logits.shape == (1, w, eng.model.cfg.vocab_size) and torch.isfinite(out.logits).all()
        assert eng.kv.length == cap
