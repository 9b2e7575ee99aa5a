"""The compiled CPU steps' ops (runtime/cpu_ops.py, runtime/csrc/cpu_ops.cpp): the attention op computes each row's
attention over the cache to float32 accuracy and a row's bits do not depend on the rows beside it; the int8 head
computes its integer dot products exactly; building or loading the library fails with a reason and leaves nothing
half-written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import cpu_ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def op(tmp_path_factory):
    """The ops built into a store of its own (or, where this process has them already, copied there)."""
    if cpu_ops.compiler() is None:
        pytest.skip("no C++ compiler: the ops cannot be built here (the packages keep torch's ops)")
    root = tmp_path_factory.mktemp("compiled")
    assert cpu_ops.ensure(root, build=True) == ""
    assert cpu_ops.registered()
    return root


def _case(gen: torch.Generator, nkv: int, grp: int, hd: int, slots: int, positions: list[int]):
    q = torch.randn(nkv, len(positions) * grp, hd, generator=gen) * 0.5
    kc = torch.randn(nkv, slots, hd, generator=gen)
    vc = torch.randn(nkv, slots, hd, generator=gen)
    return q, kc, vc, torch.tensor(positions)


@pytest.mark.parametrize("nkv,grp,hd,slots,positions", [
    (2, 2, 64, 170, [0, 15, 16, 159]),          # key counts on and off the 16-key blocks
    (1, 4, 128, 37, [36, 20]),                  # the cache's last slot, in a block it does not fill
    (4, 1, 256, 300, [299, 1, 128, 64, 200]),
    (2, 8, 128, 1030, [1000, 1001, 1002, 1003]),
])
def test_matches_float64_softmax_attention(op, nkv, grp, hd, slots, positions):
    q, kc, vc, seen = _case(torch.Generator().manual_seed(slots), nkv, grp, hd, slots, positions)
    got = torch.ops.strata.window_attention(q, kc, vc, seen, grp)
    want = cpu_ops.reference(q, kc, vc, seen, grp)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_a_strided_cache_view_is_read_as_the_package_passes_it(op):
    """The package hands the op one layer of the engine's cache ([kv heads, slots, hd] views of a larger tensor)."""
    q, _, _, seen = _case(torch.Generator().manual_seed(3), 2, 2, 64, 200, [150, 151])
    big = torch.randn(3, 2, 2, 200, 64)
    kc, vc = big[1, 0], big[2, 1]
    got = torch.ops.strata.window_attention(q, kc, vc, seen, 2)
    torch.testing.assert_close(got, cpu_ops.reference(q, kc, vc, seen, 2), rtol=2e-5, atol=2e-6)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 299), min_size=1, max_size=16), grp=st.sampled_from([1, 2, 4]),
       hd=st.sampled_from([64, 128, 256]), seed=st.integers(0, 2**16))
def test_a_bf16_cache_gives_the_bits_of_its_float_copy(op, rows, grp, hd, seed):
    """A bf16 cache (`[memory] kv_dtype = "bf16"` on a CPU) is read as the floats it holds: the same bits as the op
    over the float copy of that cache, for every row (the last slots, whose key block is padded, included)."""
    q, kc, vc, seen = _case(torch.Generator().manual_seed(seed), 2, grp, hd, 300, rows)
    kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    got = torch.ops.strata.window_attention(q, kb, vb, seen, grp)
    assert torch.equal(got, torch.ops.strata.window_attention(q, kb.float(), vb.float(), seen, grp))


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 299), min_size=1, max_size=16), pick=st.integers(0, 15),
       grp=st.sampled_from([1, 2, 4]), hd=st.sampled_from([64, 128]), seed=st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_its_window(op, rows, pick, grp, hd, seed):
    """Row `pick` of a window of random rows gives the same bits alone as inside the window (what the wide step's
    padding rows, window positions and widths vary)."""
    pick %= len(rows)
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, seen = _case(gen, 2, grp, hd, 300, rows)
    full = torch.ops.strata.window_attention(q, kc, vc, seen, grp)
    lines = slice(pick * grp, (pick + 1) * grp)
    alone = torch.ops.strata.window_attention(q[:, lines].contiguous(), kc, vc, seen[pick:pick + 1], grp)
    assert torch.equal(alone, full[:, lines])


def test_bad_input_is_refused_with_a_sentence(op):
    q, kc, vc, _ = _case(torch.Generator().manual_seed(1), 2, 2, 64, 32, [31, 30])
    with pytest.raises(RuntimeError, match="a position is outside the cache"):
        torch.ops.strata.window_attention(q, kc, vc, torch.tensor([31, 32]), 2)
    with pytest.raises(RuntimeError, match="head size 48 is not 64, 128 or 256"):
        torch.ops.strata.window_attention(torch.randn(2, 4, 48), torch.randn(2, 8, 48), torch.randn(2, 8, 48),
                                          torch.tensor([3, 4]), 2)
    with pytest.raises(RuntimeError, match="float32 queries"):
        torch.ops.strata.window_attention(q.double(), kc, vc, torch.tensor([3, 4]), 2)


@pytest.mark.parametrize("V,H,n", [(4096, 256, 1), (4100, 256, 2), (37, 128, 3), (16, 64, 1)])
def test_the_int8_head_is_its_integer_products(op, V, H, n):
    """Every row, the last ones past a multiple of 16 included (a vectorized form of the tail loop once gave those
    rows wrong values), equals the exact integer dot product times the two scales."""
    gen = torch.Generator().manual_seed(V + H)
    w = torch.randint(-127, 128, (V, H), generator=gen, dtype=torch.int8)
    scale = (torch.rand(V, generator=gen) / 50).to(torch.bfloat16)
    x = torch.randn(n, H, generator=gen)
    x[0, 3] = 40.0                                        # one large value: the rest round to smaller integers
    got = torch.ops.strata.int8_head(x, w, scale)
    assert got.shape == (n, V) and got.dtype == torch.float32
    torch.testing.assert_close(got, cpu_ops.head_reference(x, w, scale), rtol=1e-6, atol=1e-7)
    zero = torch.ops.strata.int8_head(torch.zeros(1, H), w, scale)
    assert torch.equal(zero, torch.zeros(1, V))


def test_the_int8_head_refuses_what_it_cannot_take(op):
    w = torch.zeros(8, 96, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="a multiple of 64 wide"):
        torch.ops.strata.int8_head(torch.zeros(1, 96), w, torch.ones(8))
    with pytest.raises(RuntimeError, match="takes float rows and int8 weights"):
        torch.ops.strata.int8_head(torch.zeros(1, 64), torch.zeros(8, 64), torch.ones(8))


def _moe_case(gen: torch.Generator, E: int, inter: int, H: int, W: int, k: int):
    gu = torch.randn(H, E * 2 * inter, generator=gen) / 8
    dn = torch.randn(E * inter, H, generator=gen) / 8
    h = torch.randn(W, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(W)])
    wt = torch.softmax(torch.randn(W, k, generator=gen), -1)
    return h, gu, dn, idx, wt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,inter,H,W,k", [(8, 64, 256, 4, 2), (128, 16, 64, 16, 8), (4, 32, 48, 1, 1)])
def test_the_experts_op_is_each_rows_own_experts(op, E, inter, H, W, k, dtype):
    h, gu, dn, idx, wt = _moe_case(torch.Generator().manual_seed(E * W), E, inter, H, W, k)
    gu, dn = gu.to(dtype), dn.to(dtype)
    got = torch.ops.strata.moe_rows(h, gu, dn, idx, wt, inter)
    want = cpu_ops.moe_reference(h, gu.float(), dn.float(), idx, wt, inter)      # bf16 weights: their values
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-6)


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 16), pick=st.integers(0, 15), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_an_experts_rows_bits_do_not_depend_on_its_window(op, W, pick, seed, dtype):
    """A row gives the same bits alone as among other rows (the compiled wide step's row invariance)."""
    pick %= W
    h, gu, dn, idx, wt = _moe_case(torch.Generator().manual_seed(seed), 8, 32, 64, W, 2)
    gu, dn = gu.to(dtype), dn.to(dtype)
    full = torch.ops.strata.moe_rows(h, gu, dn, idx, wt, 32)
    one = slice(pick, pick + 1)
    alone = torch.ops.strata.moe_rows(h[one].contiguous(), gu, dn, idx[one].contiguous(), wt[one].contiguous(), 32)
    assert torch.equal(alone, full[one])


@pytest.mark.parametrize("K,N,W", [(256, 512, 1), (256, 4096, 4), (96, 64, 7), (1, 128, 2)])
def test_the_bf16_product_matches_float64(op, K, N, W):
    gen = torch.Generator().manual_seed(K + N + W)
    w = torch.randn(K, N, generator=gen)
    wb = cpu_ops.blocks16(w)
    assert wb.shape == (N // 64, K, 64) and torch.equal(cpu_ops.unblocks16(wb), w.bfloat16())
    assert torch.equal(wb[0, 0, :4], w[0, torch.tensor([0, 16, 1, 17])].bfloat16())     # interleaved by 32
    x = torch.randn(W, K, generator=gen)
    got = torch.ops.strata.rows16(x, wb)
    torch.testing.assert_close(got, cpu_ops.rows16_reference(x, wb), rtol=1e-5, atol=2e-5)


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 16), pick=st.integers(0, 15), seed=st.integers(0, 2**16))
def test_a_bf16_product_rows_bits_do_not_depend_on_its_window(op, W, pick, seed):
    """The rows go four at a time sharing the weights' loads: a row's bits must still be its own."""
    pick %= W
    gen = torch.Generator().manual_seed(seed)
    wb = cpu_ops.blocks16(torch.randn(128, 192, generator=gen))
    x = torch.randn(W, 128, generator=gen)
    assert torch.equal(torch.ops.strata.rows16(x[pick:pick + 1].contiguous(), wb),
                       torch.ops.strata.rows16(x, wb)[pick:pick + 1])


def test_the_bf16_product_refuses_what_it_cannot_take(op):
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.strata.rows16(torch.zeros(1, 32), torch.zeros(2, 32, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 weights"):
        torch.ops.strata.rows16(torch.zeros(1, 32), torch.zeros(2, 32, 64))


def test_the_experts_op_refuses_what_it_cannot_take(op):
    h, gu, dn, idx, wt = _moe_case(torch.Generator().manual_seed(0), 4, 32, 64, 2, 2)
    with pytest.raises(RuntimeError, match="an expert id is out of range"):
        torch.ops.strata.moe_rows(h, gu, dn, idx + 4, wt, 32)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.strata.moe_rows(h, gu, dn, idx, wt, 48)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        torch.ops.strata.moe_rows(h, torch.randn(64, 4 * 2 * 8), torch.randn(4 * 8, 64), idx, wt, 8)


def test_the_library_lives_in_the_store_and_is_shared(op, tmp_path):
    libs = list(op.glob("cpu-ops-*.so"))
    assert len(libs) == 1 and libs[0] == cpu_ops.library_path(op, cpu_ops.compiler())
    assert cpu_ops.ensure(tmp_path, build=False) == ""          # loaded already: nothing to do
    assert cpu_ops.ensure(tmp_path, build=True) == ""           # ... and a store that builds gets a copy
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([libs[0].name, libs[0].with_suffix(".sha256").name])
    assert (tmp_path / libs[0].name).read_bytes() == libs[0].read_bytes()


def test_a_changed_source_does_not_get_the_loaded_library(op, tmp_path, monkeypatch):
    """A process holding the library of one source (its key) must not file it under another source's key."""
    src = tmp_path / "cpu_ops.cpp"
    src.write_text(cpu_ops.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_ops, "SOURCE", src)
    store = tmp_path / "store"
    assert cpu_ops.ensure(store, build=True) == ""             # this process keeps the ops it loaded
    assert not store.exists() or list(store.iterdir()) == []


def _moe8_case(gen: torch.Generator, E: int, inter: int, H: int, W: int, k: int):
    gu = torch.randint(-127, 128, (E * 2 * inter, H), generator=gen, dtype=torch.int8)
    dn = torch.randint(-127, 128, (E * H, inter), generator=gen, dtype=torch.int8)
    gus, dns = torch.rand(E * 2 * inter, generator=gen) / 500, torch.rand(E * H, generator=gen) / 500
    h = torch.randn(W, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(W)])
    return h, gu, gus, dn, dns, idx, torch.rand(W, k, generator=gen)


@pytest.mark.parametrize("E,inter,H,W,k", [(8, 64, 256, 1, 2), (8, 64, 256, 3, 2), (4, 32, 64, 2, 4)])
def test_int8_experts_match_their_integer_reference(op, E, inter, H, W, k):
    case = _moe8_case(torch.Generator().manual_seed(E + W), E, inter, H, W, k)
    got = torch.ops.strata.moe_rows8(*case, inter)
    want = cpu_ops.moe8_reference(*case, inter)
    # the activation is rounded to int16 in float32 by the op and in float64 by the reference: an integer apart
    # at a half-way point, a 1/32767 of its largest value
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_int8_experts_refuse_what_they_cannot_take(op):
    h, gu, gus, dn, dns, idx, wt = _moe8_case(torch.Generator().manual_seed(0), 4, 32, 64, 2, 2)
    with pytest.raises(RuntimeError, match="an expert id is out of range"):
        torch.ops.strata.moe_rows8(h, gu, gus, dn, dns, idx + 4, wt, 32)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.strata.moe_rows8(h, gu, gus, dn, dns, idx, wt, 16)
    with pytest.raises(RuntimeError, match="int8 weights"):
        torch.ops.strata.moe_rows8(h, gu.float(), gus, dn, dns, idx, wt, 32)


def test_int8_head_top_is_the_first_maximum_and_its_probability(op):
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-127, 128, (4096, 256), generator=gen, dtype=torch.int8)
    w[3000] = w[77]                      # two rows the same: the same logit, the first one wins
    scale = torch.full((4096,), 1e-3)
    x = torch.randn(3, 256, generator=gen)
    x[1] = w[77].float()                 # a row whose largest logit is the tied pair
    lg, tok, conf = torch.ops.strata.int8_head_top(x, w, scale)
    assert torch.equal(lg, torch.ops.strata.int8_head(x, w, scale))
    torch.testing.assert_close(lg, cpu_ops.head_reference(x, w, scale), rtol=1e-5, atol=1e-5)
    want_tok, want_conf = cpu_ops.head_top_reference(lg)
    assert torch.equal(tok, want_tok) and int(tok[1]) == 77
    torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-7)


def test_no_compiler_or_a_failing_one_gives_a_reason_and_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_ops, "_state", {"path": None, "failed": ""})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_ops.ensure(tmp_path, build=True) == "no C++ compiler (c++, g++ or clang++) on the PATH"
    bad = tmp_path / "bad-cxx"
    bad.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    store = tmp_path / "compiled"
    why = cpu_ops.ensure(store, build=True)
    assert why == "building the CPU ops failed (RuntimeError: error: this compiler is broken)"
    assert cpu_ops.ensure(store, build=True) == why            # not retried in this process
    assert not store.exists() or list(store.iterdir()) == []
    assert not cpu_ops.registered()


def test_a_damaged_library_is_refused_in_a_fresh_process(op, tmp_path):
    """A file under the library's name that is not what was built (a truncated copy, which would crash the process
    that loads it): it is hashed before loading and refused with a reason, and the packages keep the torch-op
    attention; a fresh process with the intact library loads and checks it."""
    lib = cpu_ops.library_path(tmp_path, cpu_ops.compiler())
    good = next(op.glob("cpu-ops-*.so"))
    lib.write_bytes(good.read_bytes()[:4096])
    lib.with_suffix(".sha256").write_bytes(good.with_suffix(".sha256").read_bytes())
    code = ("from pathlib import Path; from runtime import cpu_ops as c; "
            f"print(c.ensure(Path({str(tmp_path)!r}), build=False)); print(c.registered())")

    def fresh() -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr
        return out.stdout.rstrip("\n").split("\n")
    assert fresh() == [f"the CPU ops library {lib.name} is damaged (its sha256 is not the one recorded when it "
                       "was built)", "False"]
    lib.write_bytes(good.read_bytes())
    assert fresh() == ["", "True"]
