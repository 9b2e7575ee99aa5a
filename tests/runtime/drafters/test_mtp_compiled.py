"""The MTP drafter's CPU step compiled ahead of time (runtime/drafters/mtp_compiled.py): it computes what the head's
module path computes, a chain through it keeps greedy output equal to the target alone, and every way it can be
missing or wrong leaves the eager chain serving with a reason (a missing, damaged or failed package, the switch)."""

import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from bench.common import NANO, task_prompts
from calibrate.key import CalibrationKey, key_for_config
from runtime.drafters import head8, mtp_compiled
from runtime.engine import Engine
from tests.runtime.tiny import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A CPU engine with the pack's MTP drafter and its package built once into a store of its own."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the compiled step cannot be built here (the eager chain serves; "
                    "test_load_without_a_package checks that path)")
    mp = pytest.MonkeyPatch()
    mp.setenv("STRATA_COMPILE", "1")
    home = tmp_path_factory.mktemp("home")
    mp.setenv("STRATA_HOME", str(home))
    torch.set_num_threads(1)
    eng = Engine.build(NANO, "mtp", device="cpu", context=1024, block=4)
    assert eng.compile_drafter(build=False) == "not built for this machine yet (strata-setup builds it)"
    assert eng.compile_drafter(build=True) == ""
    assert eng.drafter_compiled
    # the chain's own cache went to bf16 with the compiled step (drafts need no particular bits)
    assert eng.drafter.kv.k.dtype == torch.bfloat16 and eng.kv.k.dtype == torch.float32
    yield eng, home / "compiled"
    mp.undo()


@contextmanager
def _int8_matrices(model, on: bool, experts: bool):
    """The head's fc, q/k/v and o_proj (and with `experts` its experts) replaced by their int8 rows dequantized
    (what the compiled step multiplies by, `mtp_compiled.dense8`), restored after; nothing changes when `on` is
    False."""
    a, mlp = model.mtp.layers[0].self_attn, model.mtp.layers[0].mlp
    H, E, inter = model.cfg.hidden_size, mlp.n_exp, mlp.inter
    # (tensor, its rows as the step quantizes them, back to the tensor's shape)
    rows = [(w, lambda t: t, lambda t: t) for w in (model.mtp.fc.weight, a.q_proj.weight, a.k_proj.weight,
                                                     a.v_proj.weight, a.o_proj.weight)] if on else []
    if on and experts:        # gate/up rows as they lie; down's rows are one expert's inputs to one output
        rows += [(mlp.dense_gu, lambda t: t, lambda t: t),
                 (mlp.dense_down, lambda t: t.view(H, E, inter).transpose(0, 1).reshape(E * H, inter),
                  lambda t: t.view(E, H, inter).transpose(0, 1).reshape(H, E * inter))]
    kept = [w.detach().clone() for w, _, _ in rows]
    try:
        with torch.no_grad():
            for w, to_rows, back in rows:
                q, sc = head8.quantize(to_rows(w))
                w.copy_(back(q.float() * sc.float()[:, None]))
        yield
    finally:
        with torch.no_grad():
            for (w, _, _), k in zip(rows, kept, strict=True):
                w.copy_(k)


def test_step_equals_the_module_path(built):
    eng, _ = built
    d, model = eng.drafter, eng.model
    gen = torch.Generator().manual_seed(3)
    # the shipped form, where the ops load
    assert mtp_compiled.dense8(d) and mtp_compiled.experts8(d) and mtp_compiled.attn_op(d)
    with torch.no_grad():
        d.kv.k.normal_(generator=gen)
        d.kv.v.normal_(generator=gen)
        for n in (1, 4):                     # one chained row; three committed rows and the anchor
            tok = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen)
            g = torch.randn(n, model.cfg.hidden_size, generator=gen)
            d.kv.k[0, 0, :, 9:9 + n], d.kv.v[0, 0, :, 9:9 + n] = 0, 0
            h, lg, t, conf = d.compiled(tok, g, 9)
            k, v = d.kv.k[0, 0, :, 9:9 + n].clone(), d.kv.v[0, 0, :, 9:9 + n].clone()     # written in place
            pos = torch.arange(10, 10 + n)[None]
            # the module with the int8 matrices' values: what is left is the int16 rounding of their inputs
            with _int8_matrices(model, mtp_compiled.dense8(d), mtp_compiled.experts8(d)):
                ref = model.mtp(model.model.embed_tokens(tok)[None], g[None], pos, model.rotary,
                                (d.kv.layer(0), 9))[0]
            want_lg = torch._weight_int8pack_mm(ref[-1:].to(torch.bfloat16), *d.head8).float()
            torch.testing.assert_close(h, ref[-1:], rtol=0, atol=2e-3)
            torch.testing.assert_close(lg, want_lg, rtol=0, atol=0.05 * float(want_lg.abs().max()) + 1e-3)
            assert int(lg.argmax()) == int(want_lg.argmax()) == int(t)
            torch.testing.assert_close(conf, torch.softmax(lg, -1).amax(-1), rtol=1e-5, atol=1e-6)
            # the module wrote the rows' entries at slots 9..: the compiled step wrote the same ones (each rounded
            # to the bf16 cache: a last-bit flip where the two sums differ in their last float bits)
            tol = dict(rtol=2.0 ** -7, atol=2e-3) if d.kv.k.dtype == torch.bfloat16 else dict(rtol=0, atol=2e-3)
            torch.testing.assert_close(k, d.kv.k[0, 0, :, 9:9 + n], **tol)
            torch.testing.assert_close(v, d.kv.v[0, 0, :, 9:9 + n], **tol)


def test_the_int8_copies_are_what_the_budget_counts(built):
    eng, _ = built
    d, cfg = eng.drafter, eng.model.cfg
    a, mlp = d.mtp.layers[0].self_attn, d.mtp.layers[0].mlp
    held = sum(t.numel() * t.element_size() for t in d.dense8)
    assert held == head8.dense_nbytes(cfg.hidden_size, a.nh * a.hd, a.nkv * a.hd, mlp.n_exp, mlp.inter) > 0
    assert d.memory_report()["drafter_weights"] >= held + sum(t.numel() * t.element_size() for t in d.head8)


def test_chain_through_it_is_lossless(built):
    eng, _ = built
    ids = eng.tokenizer.encode(task_prompts()["code"]).ids[:200]
    spec = eng.generate(ids, max_new_tokens=48, block=4, spec_min_p=0.0, stop_ids=set())
    alone = eng.generate(ids, max_new_tokens=48, draft=False, stop_ids=set())
    assert spec.stats["drafter_compiled"] is True
    assert spec.stats["accepted"] > 0                 # its drafts are real drafts, not noise
    assert spec.token_ids == alone.token_ids
    # the eager chain drafts the same tokens on this prompt (drafts need no bits, but these are not near ties)
    step, eng.drafter.compiled = eng.drafter.compiled, None
    try:
        eager = eng.generate(ids, max_new_tokens=48, block=4, spec_min_p=0.0, stop_ids=set())
    finally:
        eng.drafter.compiled = step
    assert eager.stats["drafter_compiled"] is False
    assert eager.token_ids == alone.token_ids
    assert eager.stats["accepted"] == spec.stats["accepted"]


def test_floor_cuts_where_the_eager_chain_does(built):
    eng, _ = built
    ids = eng.tokenizer.encode(task_prompts()["prose"]).ids[:150]
    eng.generate(ids, max_new_tokens=1, stop_ids=set())
    d = eng.drafter
    d.flush()
    pos, step = d.next_pos, d.compiled
    out: dict[str, list] = {"compiled": [], "eager": []}
    for name, c in (("compiled", step), ("eager", None)):
        d.compiled = c
        for floor in (0.0, 0.4, 0.9):
            d.kv.length = pos - 1            # each proposal from the same state (the engine observes between)
            p = d.propose(ids[-1], pos, 6, min_p=floor)
            out[name].append((p.tokens.tolist(), p.confidence))
    d.compiled = step
    lengths = [len(t) for t, _ in out["compiled"]]
    assert lengths[0] == 6 and lengths[2] < 6          # the floor cut somewhere on this prompt
    for (tc, cc), (te, ce) in zip(out["compiled"], out["eager"], strict=True):
        assert tc == te
        # the compiled step's int8 fc, q/k/v and o_proj move a probability by about 1e-2 here (the eager chain's
        # are float); none sits that close to a floor on this prompt
        torch.testing.assert_close(cc, ce, rtol=0, atol=3e-2)


def test_sampled_drafts_carry_their_distribution(built):
    from runtime.sampling import SamplingParams, make_generator

    eng, _ = built
    ids = eng.tokenizer.encode(task_prompts()["code"]).ids[:120]
    eng.generate(ids, max_new_tokens=1, stop_ids=set())          # the drafter has observed the prompt
    d = eng.drafter
    pos = d.next_pos
    prop = d.propose(ids[-1], pos, 3, sampling=SamplingParams(temperature=0.8, top_p=0.9),
                     generator=make_generator(0, torch.device("cpu")))
    assert prop.q is not None and prop.q.shape == (prop.tokens.shape[0], eng.model.cfg.vocab_size)
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(prop.tokens.shape[0]), rtol=0, atol=1e-5)
    assert bool((prop.q.gather(1, prop.tokens[:, None]) > 0).all())    # each draft drawn from its own row


def test_key_names_what_the_code_holds(built):
    eng, root = built
    assert mtp_compiled.package_path(eng.drafter, root).is_file()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []        # no temporary left
    other = Engine.build(NANO, "mtp", device="cpu", context=2048, block=4)
    assert mtp_compiled.key(other.drafter) != mtp_compiled.key(eng.drafter)      # the cache's stride differs
    assert other.compile_drafter() == "not built for this machine yet (strata-setup builds it)"


def test_package_under_a_wrong_name_is_caught(built, tmp_path, monkeypatch):
    # the package of a step with int8 matrices passed off as one with float matrices (the same inputs, other
    # tensors in them): it loads, and the check at load refuses it
    eng, root = built
    shipped = mtp_compiled.package_path(eng.drafter, root)
    monkeypatch.setattr(mtp_compiled, "DENSE8", False)
    other = Engine.build(NANO, "mtp", device="cpu", context=1024, block=4)
    assert mtp_compiled.package_path(other.drafter, root) != shipped
    shutil.copy(shipped, mtp_compiled.package_path(other.drafter, tmp_path))
    step, why = mtp_compiled.load(other.drafter, tmp_path)
    assert step is None
    assert why.startswith("the package mtp-step-") and "does not compute the step (" in why


def test_damaged_package_is_refused(built, tmp_path):
    eng, root = built
    bad = tmp_path / "compiled"
    bad.mkdir()
    mtp_compiled.package_path(eng.drafter, bad).write_bytes(b"not a package")
    step, why = mtp_compiled.load(eng.drafter, bad)
    assert step is None and why.startswith("the package mtp-step-") and "would not load" in why


def test_check_catches_a_wrong_step(built):
    eng, root = built
    runner = torch._inductor.aoti_load_package(str(mtp_compiled.package_path(eng.drafter, root)))

    def off_by_a_bit(*args):
        h, lg, t, conf = runner(*args)
        return h, lg + 0.5, t, conf

    def writes_nothing(*args):        # the right outputs, but the rows' entries never reach the cache
        return runner(*args[:3], args[3].clone(), args[4].clone(), *args[5:])

    mtp_compiled.check(eng.drafter, runner)                       # the real package passes
    with pytest.raises(RuntimeError, match="the compiled MTP step's logits differ from the eager step's"):
        mtp_compiled.check(eng.drafter, off_by_a_bit)
    with pytest.raises(RuntimeError, match="the compiled MTP step's k differ from the eager step's"):
        mtp_compiled.check(eng.drafter, writes_nothing)


def test_failed_build_leaves_the_eager_chain_and_no_file(built, tmp_path, monkeypatch):
    eng, _ = built
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))

    def no_compiler(*a, **k):
        raise RuntimeError("C++ compile error\nmore lines")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    step = eng.drafter.compiled
    try:
        assert eng.compile_drafter(build=True) == "building it failed (RuntimeError: C++ compile error)"
        assert not eng.drafter_compiled
        left = [p.name for p in (tmp_path / "compiled").iterdir() if not p.name.startswith("cpu-ops-")]
        assert left == []                     # no package, no temporary (the C++ ops' library may be there)
    finally:
        eng.drafter.compiled = step


def test_switch_and_calibration_key(built, monkeypatch):
    eng, _ = built
    cfg = {"target": {"sha256": "a" * 64}, "drafter": {"kind": "mtp"}, "memory": {"context": 1024},
           "device": {"type": "cpu"}}
    on = key_for_config(cfg, device=("cpu", 1))
    assert on.drafter_step == "target+compiled"      # the target's step and the chain (a bf16 target: float here)
    q4 = dict(cfg, target={"sha256": "a" * 64, "quantization": "q4_0"})
    assert key_for_config(q4, device=("cpu", 1)).drafter_step == "compiled"      # the chain alone
    monkeypatch.setenv("STRATA_COMPILE", "0")
    step = eng.drafter.compiled
    try:
        assert eng.compile_drafter() == "switched off (STRATA_COMPILE=0)" and not eng.drafter_compiled
    finally:
        eng.drafter.compiled = step
    off = key_for_config(cfg, device=("cpu", 1))
    assert off.drafter_step == "" and off.digest != on.digest
    # a key without the field (stored before it existed) names the same file as the eager step's
    assert CalibrationKey.from_dict({k: v for k, v in off.to_dict().items() if k != "drafter_step"}).digest \
        == off.digest


def test_short_context_stays_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_COMPILE", "1")
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    eng = Engine.build(NANO, "mtp", device="cpu", context=100, block=3)
    assert eng.compile_drafter(build=True) == "the context is under 128 tokens"
    assert not (tmp_path / "compiled").exists()


def test_load_without_a_package(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_COMPILE", "1")
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    eng = Engine.build(NANO, "mtp", device="cpu", context=256, block=3)
    assert not eng.drafter_compiled
    assert eng.compiled_why == "not built for this machine yet (strata-setup builds it)"
    assert not Path(tmp_path / "compiled").exists()


def test_stats_line_names_the_compiled_chain():
    from runtime.cli import _summary

    stats = {"drafter": "mtp", "device": "cpu (x86_64)", "prompt_tokens": 3, "generated_tokens": 5, "decode_s": 0.01,
             "decode_tok_s": 400.0, "windows": 2, "accepted": 2, "proposed": 3, "accepted_per_window": [1, 1]}
    assert _summary({**stats, "drafter_compiled": True}).startswith("[mtp (compiled chain) on cpu (x86_64)] prompt 3")
    assert _summary({**stats, "drafter_compiled": False}).startswith("[mtp on cpu (x86_64)] prompt 3")


@pytest.mark.parametrize("step, line", [
    ({"compiled": True, "why_not": None, "compile_s": 12.34},
     "the drafter's chain ran compiled for this CPU (built or loaded in 12.3 s, outside the budget)"),
    ({"compiled": False, "why_not": "building it failed (RuntimeError: no compiler)", "compile_s": 0.5},
     "the drafter's chain ran eagerly (its compiled step: building it failed (RuntimeError: no compiler))"),
    ({"compiled": False, "why_not": "no compiled step for this drafter", "compile_s": 0.0}, None),
])
def test_calibration_summary_says_how_the_chain_ran(step, line):
    from types import SimpleNamespace

    from calibrate.report import summary_lines

    rec = {"seconds": 20.0, "total_s": 21.0, "budget_s": 30, "drafter_step": step}
    lines = summary_lines(SimpleNamespace(block=4, spec_min_p=0.0, decision="winner", reason="r", record=rec,
                                          reused=False, path=None))
    chain = [x for x in lines if x.startswith("the drafter's chain")]
    assert chain == ([line] if line else [])
