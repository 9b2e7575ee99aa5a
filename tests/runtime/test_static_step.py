"""The fixed-width decode/verify step (runtime/static_step.py) computes what the plain forward computes, padded
windows leave no trace, and greedy speculative decoding through it equals target-only decoding through it.
On CPU the step runs eagerly through its torch fallbacks; the Triton kernels are checked in the interpreter."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.drafters.mtp import MTPDrafter
from runtime.gpu.static_step import StaticStep
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.speculative import generate_ids
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_target(tmp_path_factory.mktemp("static"), seed=3, scale=2.0)
    return load_target(folder)


def _kv(m, cap=64):
    c = m.cfg
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap)


# how a CPU window's rows attend: together (static_step.CPU_WINDOW_CHUNK: the shipped chunk, one chunk of the
# cache here; 16 positions, so windows straddle chunks), or each alone (0), the keys before a chunk shared from
# position 6 (CPU_SHARED_FROM / CPU_SHARED_CHUNK, small here)
ATTEND = {"window": {}, "window-chunks": {"CPU_WINDOW_CHUNK": 16}, "rows": {"CPU_WINDOW_CHUNK": 0},
          "rows-shared": {"CPU_WINDOW_CHUNK": 0, "CPU_SHARED_FROM": 6, "CPU_SHARED_CHUNK": 2}}


def _attend(monkeypatch, mode: str) -> None:
    from runtime.gpu import static_step

    for name, value in ATTEND[mode].items():
        monkeypatch.setattr(static_step, name, value)


@pytest.mark.parametrize("attend", list(ATTEND))
def test_step_matches_plain_forward(model, attend, monkeypatch):
    """The step's rows equal the plain forward's within fp32 rounding, however a window's rows attend (`ATTEND`)."""
    _attend(monkeypatch, attend)
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    kv_a, kv_b = _kv(model), _kv(model)
    with torch.no_grad():
        model(prompt, kv=kv_a)
        model(prompt, kv=kv_b)
        step = StaticStep(model, kv_b, width=4, graph=False)
        taps = (0, 2)
        for win in ([[12]], [[3, 4, 5]], [[40, 41, 42, 43]], [[8, 9]]):
            w = torch.tensor(win)
            ref = model(w, kv=kv_a, taps=taps)
            got = step(w, kv_b, taps)
            assert kv_a.length == kv_b.length
            assert torch.allclose(got.logits, ref.logits, atol=1e-4, rtol=0)
            assert torch.allclose(got.hidden, ref.hidden, atol=1e-4, rtol=0)
            assert torch.allclose(got.taps, ref.taps, atol=1e-4, rtol=0)
            kv_a.rollback(kv_a.length - 1)          # as after a rejected last row
            kv_b.rollback(kv_b.length - 1)
        ka, va = kv_a.committed()
        kb, vb = kv_b.committed()
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


def test_greedy_speculative_through_step_equals_target_only(model):
    prompt = [5, 6, 7, 8, 9, 10, 3]
    kv = _kv(model, 96)
    step = StaticStep(model, kv, width=4, graph=False)
    ref = generate_ids(model, kv, prompt, max_new_tokens=20, step=step)
    plain = generate_ids(model, _kv(model, 96), prompt, max_new_tokens=20)
    assert ref.token_ids == plain.token_ids
    for block, min_p in ((2, 0.0), (4, 0.0), (4, 0.3)):
        out = generate_ids(model, kv, prompt, drafter=MTPDrafter(model, 96, max_block=4), block=block,
                           spec_min_p=min_p, max_new_tokens=20, step=step)
        assert out.token_ids == ref.token_ids


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_attention_kernels_in_interpreter():
    """Split decode attention (long contexts, row invariance across widths and capacities, split = unsplit),
    q8_0 cache writes and reads, and the step over a q8_0 cache: runs without the MoE kernels."""
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script), "attention"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "attention ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_triton_kernels_in_interpreter():
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "kernels ok" in r.stdout, r.stderr[-2000:]


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return load_target(make_tiny_target(tmp_path_factory.mktemp("static32"), seed=3, scale=2.0, head_dim=32))


@pytest.mark.parametrize("attend", [*ATTEND, "window-tail"])
@pytest.mark.parametrize("quant", [None, "q8_0"])
def test_cpu_step_gives_a_token_the_same_bits_alone_or_in_any_window(model, model32, quant, attend, monkeypatch):
    """On the CPU the engine's step is row-invariant: a token's logits, hidden row and taps are bitwise the same
    whether it is decoded alone or verified at any row of a wider window (what greedy equality needs: a 1e-7
    difference can flip a near-tie), with a float or a q8_0 KV cache. The plain forward gives no such promise
    (1-row and k-row products differ). `attend` (`ATTEND`): a window's rows attending together over chunks of
    the cache (windows that straddle a chunk, or start past it; "window-tail": a 40-position cache, so the last
    16-position chunk is short and windows read it), or each alone (with the keys before a chunk shared from
    position 6): every row gets its own bits still."""
    _attend(monkeypatch, "window-chunks" if attend == "window-tail" else attend)
    cap = 40 if attend == "window-tail" else 64
    if quant is not None:
        model = model32              # q8_0 blocks need a head_dim that is a multiple of 32
    # with a 12-token prompt the rows sit at positions 12-18, across the chunk boundary at 16; with 20 at 20-26,
    # and an 8-row window from position 25 on reads a chunk more (keys to 48, or the cache's end) than one before
    for plen in (12, 20):
        _same_bits_alone_or_in_windows(model, torch.tensor([([5, 9, 11, 2, 7, 30] * 4)[:plen]]), quant, cap)


def _same_bits_alone_or_in_windows(model, prompt, quant, cap):
    seq = [12, 40, 3, 8, 41, 4, 5]
    width = 8
    outs = {}
    for split in ((1,) * 7, (3, 4), (2, 5), (7,), (1, 6), (4, 1, 2)):
        c = model.cfg
        kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap, quant=quant)
        with torch.no_grad():
            model(prompt, kv=kv)
            step = StaticStep(model, kv, width=width, graph=False)
            rows, i = [], 0
            for n in split:
                o = step(torch.tensor([seq[i:i + n]]), kv, (0, 2))
                rows += [(o.logits[0, j], o.hidden[0, j], o.taps[0, j]) for j in range(n)]
                i += n
        outs[split] = rows
        k, v = kv.committed()
        outs[split, "kv"] = (k.clone(), v.clone())
    ref = outs[(1,) * 7]
    for split, rows in outs.items():
        if "kv" in split:
            assert torch.equal(rows[0], outs[(1,) * 7, "kv"][0]) and torch.equal(rows[1], outs[(1,) * 7, "kv"][1])
            continue
        for (la, ha, ta), (lb, hb, tb) in zip(rows, ref, strict=True):
            assert torch.equal(la, lb) and torch.equal(ha, hb) and torch.equal(ta, tb), split


def test_cpu_one_row_step_calls_the_experts_directly_with_the_loops_bits(model, monkeypatch):
    """A one-row CPU step runs the row's experts directly (static_step.CPU_ONE_ROW_DIRECT), bitwise what the
    grouping loop gives (logits, hidden row, taps, and the greedy tokens of a generation)."""
    from runtime.gpu import static_step

    calls = []
    monkeypatch.setattr(static_step, "_one_row_experts",
                        lambda *a, _f=static_step._one_row_experts: calls.append(1) or _f(*a))
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    got = {}
    for direct in (True, False):
        monkeypatch.setattr(static_step, "CPU_ONE_ROW_DIRECT", direct)
        kv = _kv(model)
        with torch.no_grad():
            model(prompt, kv=kv)
            step = StaticStep(model, kv, width=1, graph=False)
            got[direct] = [step(torch.tensor([[t]]), kv, (0, 2)) for t in (12, 40, 3, 8)]
    assert calls and len(calls) % model.cfg.num_hidden_layers == 0
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden) and torch.equal(a.taps, b.taps)
    toks = {}
    for direct in (True, False):
        monkeypatch.setattr(static_step, "CPU_ONE_ROW_DIRECT", direct)
        kv = _kv(model, 96)
        toks[direct] = generate_ids(model, kv, [5, 6, 7, 8, 9, 10, 3], max_new_tokens=24, stop_ids=set(),
                                    step=StaticStep(model, kv, width=1, graph=False)).token_ids
    assert toks[True] == toks[False]


def test_cpu_engine_runs_every_window_through_the_step(tmp_path, monkeypatch):
    """The engine on the CPU builds the fixed-width step (its step width: the configured block) and every window
    goes through it, target-only and speculative alike."""
    from runtime.engine import Engine

    eng = Engine.build(make_tiny_target(tmp_path, seed=3, scale=2.0), "mtp", device="cpu", context=64, block=4)
    plain = eng.generate("hello world", max_new_tokens=16, draft=False, stop_ids=set())
    step = eng.step
    assert step is not None and step.width == eng.step_width == 4 and step.cpu and not step.use_graph
    seen = []
    real = StaticStep.__call__

    def spy(self, window, kv, taps=()):
        seen.append(window.shape[1])
        return real(self, window, kv, taps)

    monkeypatch.setattr(StaticStep, "__call__", spy)
    spec = eng.generate("hello world", max_new_tokens=16, stop_ids=set(), spec_min_p=0.0)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["windows"] == len(seen) and max(seen) > 1


@pytest.mark.parametrize("width", [1, 4])
def test_cpu_merged_qk_norm_and_rope_give_the_modules_bits(model, monkeypatch, width):
    """The CPU step's q/k post-processing as one RMSNorm and one RoPE over a window's q and k heads
    (`layers.qkv_rows`) gives the bits of the separate q-norm, k-norm and RoPE (`project_qkv`), with the norms as
    RMSNorm computes them (static_step.CPU_FEWER_OPS off; on, the step's bits are its own: the tests above)."""
    from runtime.gpu import static_step

    for layer in model.model.layers:
        layer.self_attn.stack_qkv()          # as the engine holds them on a CPU (runtime/experts.py)
    monkeypatch.setattr(static_step, "CPU_FEWER_OPS", False)
    calls = []
    real = static_step.qkv_rows
    monkeypatch.setattr(static_step, "qkv_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    outs = {}
    for merged in (False, True):
        monkeypatch.setattr(static_step, "CPU_QK_MERGED", merged)
        kv = _kv(model)
        with torch.no_grad():
            model(torch.tensor([[5, 9, 11, 2, 7, 30]]), kv=kv)
            step = StaticStep(model, kv, width=width, graph=False)
            o = step(torch.tensor([[12, 40, 3, 8][:width]]), kv)
        outs[merged] = (o.logits, o.hidden, kv.k.clone(), kv.v.clone())
    assert len(calls) == model.cfg.num_hidden_layers          # the merged path ran (once per layer)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 8])
def test_cpu_step_on_a_placed_model_matches_the_plain_forward_and_keeps_its_bits(tmp_path, width):
    """As a CPU engine holds a small model (experts packed, q/k/v stacked, weights input-major: a row's experts
    routed through their packed rows below E/k rows, a window's all at once from there, `cpu_rows`): each row
    within fp32 rounding of the plain forward, and a token's bits the same alone or anywhere in a window."""
    from runtime.cpu_layout import relayout

    m = load_target(make_tiny_target(tmp_path, seed=5, scale=2.0))
    for layer in m.model.layers:
        assert layer.mlp.pack_dense()
        layer.self_attn.stack_qkv()
    assert relayout(m) > 0
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    seq = [12, 40, 3, 8, 41, 4, 5, 9]
    if width == 1:
        splits = [(1,) * 8]
    else:
        splits = [(1,) * 8, (width,) * (8 // width) + ((8 % width,) if 8 % width else ()),
                  (1,) + (width,) * (7 // width) + ((7 % width,) if 7 % width else ())]
    rows_by_split = []
    with torch.no_grad():
        kv_ref = _kv(m)
        ref = m(torch.cat((prompt, torch.tensor([seq])), 1), kv=kv_ref).logits[0, prompt.shape[1]:]
        for split in splits:
            kv = _kv(m)
            m(prompt, kv=kv)
            step = StaticStep(m, kv, width=width, graph=False)
            rows, i = [], 0
            for n in split:
                rows += list(step(torch.tensor([seq[i:i + n]]), kv).logits[0, :n])
                i += n
            rows_by_split.append(torch.stack(rows))
    torch.testing.assert_close(rows_by_split[0], ref, rtol=0, atol=1e-4)
    for rows in rows_by_split[1:]:
        assert torch.equal(rows, rows_by_split[0])


@pytest.mark.parametrize("width", [5, 8])
def test_cpu_window_attention_gives_a_row_the_same_bits_at_any_slot_start_and_fill(width):
    """`StaticStep._attend_window` at the bundled pack's attention shape (2 KV heads of 64, 2 query heads each) and
    contexts of hundreds of positions, where one values product over the whole context would round a row
    differently as the window's end moves (BLAS splits a long sum by its length): a row's output is bitwise the
    same whichever slot of the window it takes, so whatever the window's start, its count of real rows and the
    other rows' queries, across chunk boundaries and the cache's short last chunk."""
    from types import SimpleNamespace

    from runtime.gpu.static_step import CPU_WINDOW_CHUNK, StaticStep

    g = torch.Generator().manual_seed(width)
    nkv, grp, hd, S = 2, 2, 64, 2 * CPU_WINDOW_CHUNK + 100          # the last chunk holds 100 positions
    keys, vals = torch.randn(nkv, S, hd, generator=g), torch.randn(nkv, S, hd, generator=g)
    for p in (CPU_WINDOW_CHUNK - 3, CPU_WINDOW_CHUNK + 2, 2 * CPU_WINDOW_CHUNK - 2, S - 2):
        row = torch.randn(nkv * grp, hd, generator=g)
        got = []
        for j in range(width):
            start = p - j
            if start + j + 1 > S:
                continue
            n = int(torch.randint(j + 1, width + 1, (1,), generator=g))
            n = min(n, S - start)
            st = SimpleNamespace(window=(start, n), width=width, ar=torch.arange(width))
            q = torch.randn(width, nkv * grp, hd, generator=g)
            q[j] = row
            wm = StaticStep._window_mask(st, S)
            got.append(StaticStep._attend_window(st, q, keys, vals, nkv, wm)[j])
        assert len(got) == width
        assert all(torch.equal(o, got[0]) for o in got), p
        ref = torch.softmax(row.view(nkv, grp, hd) @ keys[:, :p + 1].transpose(1, 2), -1) @ vals[:, :p + 1]
        assert torch.allclose(got[0], ref.reshape(nkv * grp, hd), atol=1e-5)


def test_a_step_that_falls_back_says_so(model):
    """A kernel that fails on this machine sends the step down one level (fused -> unfused kernels -> plain torch)
    with one warning naming the error's last line, so a user is not left with a slower step and no word why."""
    step = StaticStep(model, _kv(model), width=1, graph=False)
    step.fused, step.use_kernels = True, True
    err = RuntimeError("at 62:4:\n    for c in range(first, n_valid, step):\n    ^\nAssertionError('Loop-carried variable')")
    with pytest.warns(RuntimeWarning, match=r"fused decode step failed here \(RuntimeError: AssertionError\('Loop-"
                                            r"carried variable'\)\); the unfused kernels from now on"):
        step._degrade(err)
    assert not step.fused and step.use_kernels and "Loop-carried" in step.errors[0]
    with pytest.warns(RuntimeWarning, match=r"Triton decode step failed here .*; plain torch from now on"):
        step._degrade(ValueError("no"))
    assert not step.use_kernels and len(step.errors) == 2
