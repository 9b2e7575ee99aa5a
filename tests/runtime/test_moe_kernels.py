"""The routed-expert kernels (runtime/gpu/moe_kernels.py): their torch side (grouping, prefill block tables, the
expert->slot table and miss path, quantized experts in SparseMoe's fallback) here, the Triton kernels under the CPU
interpreter in a subprocess (tests/runtime/kernels_check.py moe)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.errors import QuantFormatError
from runtime.formats.blocks import dequantize, quantize
from runtime.formats.registry import FORMATS, QTYPES, block_format, row_bytes
from runtime.gpu import moe_gemv, moe_kernels
from runtime.models.layers import SparseMoe
from runtime.models.target_config import Qwen3MoeConfig
from tests.runtime.tiny import single_thread, tiny_config  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_moe_kernels_in_interpreter():
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script), "moe"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "moe kernels ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("part", ["0", "1"])
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_moe_gemv_variants_in_interpreter(part):
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script), "moe_gemv", part], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "moe gemv kernels ok" in r.stdout, r.stderr[-3000:]


def test_gemv_steps_divide_rows_and_warps_never_split_rows():
    # A3B rows: gate/up rows of 2048 values, down rows of 768 (= 3 x 256: K-quant steps of one super-block)
    assert moe_gemv.chunk(2048, "q4_0", 512) == 16 and moe_gemv.chunk(768, "q4_0", 512) == 8
    assert moe_gemv.chunk(768, "q4_k", 512) == 1 and moe_gemv.chunk(2048, "q6_k", 512) == 2
    assert moe_gemv.chunk(2048, "bf16", 256) == 256 and moe_gemv.chunk(40, "bf16", 256) == 16   # 40: masked tail
    # one-step variants: a float row in one step of its power-of-two cover (tail masked) when KV holds it, else the
    # usual steps; 32-value block rows too, in blocks (24 blocks of a 768-value row: a 32-block tile, the tail's
    # scales zero); K-quants keep their steps
    assert moe_gemv.chunk(768, "bf16", 4096, True) == 1024 and moe_gemv.chunk(2048, "bf16", 2048, True) == 2048
    assert moe_gemv.chunk(768, "bf16", 512, True) == 256 and moe_gemv.chunk(768, "bf16", 4096) == 256
    assert moe_gemv.chunk(2048, "q4_0", 512, True) == 16 and moe_gemv.chunk(2048, "q4_0", 4096, True) == 64
    assert moe_gemv.chunk(768, "q4_0", 4096, True) == 32 and moe_gemv.chunk(768, "q4_0", 4096) == 8
    assert moe_gemv.chunk(768, "q4_k", 4096, True) == 1 and not moe_gemv.one_step("q4_k", 768, 1)
    assert moe_gemv.one_step("bf16", 768, 1024) and not moe_gemv.one_step("bf16", 768, 512)
    assert moe_gemv.one_step("q4_0", 768, 32) and not moe_gemv.one_step("q4_0", 768, 8)
    assert moe_gemv.one_step("q8_0", 2048, 64) and not moe_gemv.one_step("q8_0", 2048, 16)
    for fmt in ("q8_0", "q5_0", "q4_0", "q6_k", "q4_k", "q5_k", "q3_k", "q2_k", "iq4_xs"):
        for k in (768, 2048):
            c = moe_gemv.chunk(k, fmt, 512)
            assert (k // moe_gemv.BLOCK_VALUES[moe_gemv.QT[fmt]]) % c == 0
    # a q4_0 step of 8 blocks spans 4 x 8 threads per warp: 2 warps cover it, a third would split the rows
    assert moe_gemv._warps("q4_0", 8, 4) == 2 and moe_gemv._warps("q4_0", 16, 4) == 4
    assert moe_gemv._warps("q8_0", 8, 4) == 4 and moe_gemv._warps("q4_k", 1, 4) == 2
    # Q2_K / Q3_K: groups of 8 words (4 a super-block), 4 groups a warp: a step of 2 super-blocks takes 2 warps
    assert moe_gemv._warps("q3_k", 2, 4) == 2 and moe_gemv._warps("q2_k", 1, 4) == 1
    assert moe_gemv._warps("iq4_xs", 2, 4) == 4 and moe_gemv._warps("iq4_xs", 1, 4) == 2     # 8 groups a block


def test_decode_gemv_names_a_variant(monkeypatch):
    assert all(v is None or v in moe_gemv.GEMV_VARIANTS for v in moe_gemv.DECODE_GEMV.values())
    assert set(moe_gemv.DECODE_GEMV) == set(moe_kernels.QCODE)
    monkeypatch.setitem(moe_gemv.DECODE_GEMV, "q4_0", "nope")
    with pytest.raises(ValueError, match="not in GEMV_VARIANTS"):
        moe_gemv.variant("q4_0")
    # a format the GEMV code does not read (its blocks would decode as another's) never gets a variant
    assert all(moe_gemv.DECODE_GEMV[f] is None for f in moe_gemv.QT if f not in moe_gemv.GEMV_FORMATS)
    assert set(moe_gemv.GEMV_FORMATS) == set(moe_gemv.QT)              # today the GEMV code reads them all
    monkeypatch.setattr(moe_gemv, "GEMV_FORMATS", tuple(f for f in moe_gemv.GEMV_FORMATS if f != "iq4_nl"))
    with pytest.raises(ValueError, match="do not read iq4_nl"):
        moe_gemv.variant("iq4_nl")


def test_quant_one_row_table(monkeypatch):
    """The fused step's block-format one-row products: QUANT_ONE_ROW names variants by (format, role); a role it
    does not name, a window of several rows or a float module take the caller's path (None); a bad name is one
    sentence."""
    import torch

    from runtime.formats.quant_linear import QuantLinear
    from runtime.gpu import dense_kernels

    assert all(v in moe_gemv.GEMV_VARIANTS for v in dense_kernels.QUANT_ONE_ROW.values())
    assert all(f in moe_gemv.QT and r in ("qkv", "o_proj", "router", "lm_head") for f, r in dense_kernels.QUANT_ONE_ROW)
    lin = QuantLinear.from_float(torch.randn(8, 64), "q8_0")
    monkeypatch.setattr(dense_kernels, "QUANT_ONE_ROW", {("q8_0", "o_proj"): "nope"})
    assert dense_kernels.quant_one_row(torch.randn(1, 64), lin, "qkv") is None
    assert dense_kernels.quant_one_row(torch.randn(2, 64), lin, "o_proj") is None
    assert dense_kernels.quant_one_row(torch.randn(1, 64), torch.nn.Linear(64, 8), "o_proj") is None
    with pytest.raises(ValueError, match="not in GEMV_VARIANTS"):
        dense_kernels.quant_one_row(torch.randn(1, 64), lin, "o_proj")


def test_variant_by_window_width(monkeypatch):
    """One row: DECODE_GEMV_ONE_ROW; 2..n rows: DECODE_GEMV_NARROW's (n, variant); wider: DECODE_GEMV (None: the
    tl.dot tiles). The choice depends on the row count alone."""
    monkeypatch.setattr(moe_gemv, "DECODE_GEMV_ONE_ROW", {"bf16": "u1d32"})
    monkeypatch.setattr(moe_gemv, "DECODE_GEMV_NARROW", {"bf16": (3, "n16d32")})
    monkeypatch.setitem(moe_gemv.DECODE_GEMV, "bf16", None)
    V = moe_gemv.GEMV_VARIANTS
    assert moe_gemv.variant("bf16", 1) is V["u1d32"]
    assert moe_gemv.variant("bf16", 2) is V["n16d32"] and moe_gemv.variant("bf16", 3) is V["n16d32"]
    assert moe_gemv.variant("bf16", 4) is None and moe_gemv.variant("bf16") is None
    assert moe_gemv.variant("q4_0", 2) is V[moe_gemv.DECODE_GEMV["q4_0"]]
    monkeypatch.setattr(moe_gemv, "DECODE_GEMV_NARROW", {"bf16": (3, "nope")})
    with pytest.raises(ValueError, match="DECODE_GEMV_NARROW.*not in GEMV_VARIANTS"):
        moe_gemv.variant("bf16", 2)


def test_a_variant_pairs_two_tiles_and_refuses_formats_it_cannot_read(monkeypatch):
    """The Q4_K one-row experts' variant runs gate/up on the row-by-row tile of eight words a thread and the down
    products on a looped tile (keys ending in _UP / _DOWN override the shared ones for that kernel); a table naming
    a row-by-row width for a format without it is refused in one sentence, as is a kernel call with it."""
    V = moe_gemv.GEMV_VARIANTS
    cfg = moe_gemv.variant("q4_k", 1)
    assert cfg is V["rk8u4d16"] and moe_gemv.variant("q4_k", 2) is V[moe_gemv.DECODE_GEMV["q4_k"]]
    up, down = moe_gemv._side(cfg, "UP"), moe_gemv._side(cfg, "DOWN")
    assert (up["R1"], up["KV"], up["num_warps"], up["BN_UP"]) == (8, 2048, 4, 4)
    assert "R1" not in down and (down["KV"], down["num_warps"], down["BN_DOWN"]) == (1024, 8, 16)
    assert moe_gemv._side(V["n8j2np"], "UP") is V["n8j2np"]
    assert moe_gemv.refuses("q4_k", cfg) is None and moe_gemv.refuses("q4_0", V["r4d8k2w4j2"]) is None
    monkeypatch.setitem(moe_gemv.DECODE_GEMV_ONE_ROW, "q8_0", "rk8u4d16")
    with pytest.raises(ValueError, match=r"names 'rk8u4d16', a row-by-row tile of 8 words a thread, which reads q4_k"):
        moe_gemv.variant("q8_0", 1)
    monkeypatch.setitem(moe_gemv.DECODE_GEMV, "q4_k", "r2d4k2w4")
    with pytest.raises(ValueError, match=r"Q4_K tile of 1 word a thread \(it takes 2, 4 or 8\)"):
        moe_gemv.variant("q4_k")
    with pytest.raises(ValueError, match="q4_0 weights cannot take a row-by-row tile of 4 words a thread"):
        moe_gemv._r1("q4_0", V["r4d8k2w4j4"])


@pytest.mark.parametrize("bm", [1, 4, 16])
def test_block_table_covers_every_pair_once_in_single_expert_tiles(bm):
    g = torch.Generator().manual_seed(bm)
    E = 7
    ids = torch.randint(0, E, (45,), generator=g)
    ids[[3, 9]] = E                                   # padded pairs: never in a tile
    se, _ = torch.sort(ids.to(torch.int32), stable=True)
    bs, bc, G = moe_kernels.block_table(se, E, bm)
    assert bs.shape == bc.shape == (G,)
    assert G == (45 + bm - 1) // bm + E               # static: a function of the pair count and E only
    seen = []
    for s, c in zip(bs.tolist(), bc.tolist(), strict=True):
        assert 0 <= c <= bm
        if c:
            rows = list(range(s, s + c))
            assert len({int(se[i]) for i in rows}) == 1 and int(se[s]) < E
            seen += rows
    assert sorted(seen) == list(range(43))            # every real pair exactly once


def test_group_lists_misses_by_expert():
    idx = torch.tensor([[0, 3], [2, 0], [3, 1], [4, 4]])
    idx[3] = 5                                        # a padded row (E = 5)
    slot = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32)
    r = moe_kernels.group(idx, torch.ones(4, 2), 5, slot)
    assert r.se.tolist() == [0, 0, 1, 2, 3, 3, 5, 5]
    assert r.order.tolist() == [0, 3, 5, 2, 1, 4, 6, 7]
    assert r.tok.tolist() == [0, 1, 2, 1, 0, 2, 3, 3]
    assert int(r.n_miss[0]) == 3 and r.miss.tolist() == [5, 1, 4, -1, -1, -1, -1, -1]   # expert 1, then 3
    r = moe_kernels.group(idx, torch.ones(4, 2), 5)
    assert int(r.n_miss[0]) == 0 and bool((r.miss == -1).all())


def _moe(seed: int = 0, **kw) -> SparseMoe:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig.from_dict(tiny_config(hidden=64, moe_inter=32, experts=6, top_k=2, **kw))
    m = SparseMoe(cfg).eval()
    return m


def test_quantized_experts_run_through_the_torch_fallback():
    m = _moe()
    ref = _moe()
    x = torch.randn(9, 64)
    m.stack_experts()
    E, two_i, H = m.gate_up.shape
    gu = quantize(m.gate_up.reshape(-1, H).detach().numpy(), "q4_0")
    dn = quantize(m.down.reshape(E * H, -1).detach().numpy(), "q4_0")
    with pytest.raises(QuantFormatError, match="are not q8_0"):
        m.bind_blocks(torch.from_numpy(gu).view(E, two_i, -1), torch.from_numpy(dn).view(E, H, -1), "q8_0")
    m.bind_blocks(torch.from_numpy(gu).view(E, two_i, -1), torch.from_numpy(dn).view(E, H, -1), "q4_0")
    assert m.quantized and m.fmt == "q4_0" and len(m.experts) == 0
    # the reference: the plain per-expert loop over the dequantized weights
    with torch.no_grad():
        for e, ex in enumerate(ref.experts):
            gw = torch.from_numpy(dequantize(gu.reshape(E, two_i, -1)[e], "q4_0"))
            ex.gate_proj.weight.copy_(gw[: two_i // 2])
            ex.up_proj.weight.copy_(gw[two_i // 2:])
            ex.down_proj.weight.copy_(torch.from_numpy(dequantize(dn.reshape(E, H, -1)[e], "q4_0")))
        got, want = m(x), ref(x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_partial_residency_with_a_miss_path_gives_the_all_resident_bits():
    m = _moe(1)
    m.stack_experts()
    x = torch.randn(11, 64)
    with torch.no_grad():
        full = moe_kernels.moe_torch(x, *reversed(m.route(x)), m.gate_up, m.down)
        resident = [4, 0, 5]                          # slot -> expert
        slot = torch.full((6,), -1, dtype=torch.int32)
        slot[resident] = torch.arange(3, dtype=torch.int32)
        gs, ds = m.gate_up[resident].clone(), m.down[resident].clone()
        missed = [e for e in range(6) if e not in resident]
        g_miss, d_miss = m.gate_up[missed].clone(), m.down[missed].clone()    # staging slots
        stage = torch.full((6,), -1, dtype=torch.int32)
        stage[missed] = torch.arange(3, dtype=torch.int32)
        seen = []

        def miss_fn(xx, r, y):
            seen.append(r.miss[: int(r.n_miss[0])].tolist())
            moe_kernels.experts_torch(xx, r, g_miss, d_miss, slot=stage, y=y, zero_missing=False)

        m.gate_up, m.down, m.slot = gs, ds, slot
        no_path = m(x)
        m.miss_fn = miss_fn
        got = m(x)
    assert torch.equal(got, full)
    w, idx = m.route(x)
    pairs = [p for p in range(22) if int(idx.view(-1)[p]) in missed]
    assert sorted(seen[-1]) == pairs
    assert not torch.equal(no_path, full)             # without the miss path the missed experts add nothing


def test_k_quants_are_read_only_formats():
    assert "q6_k" in FORMATS and "q4_k" in FORMATS
    assert "q6_k" not in QTYPES and "q4_k" not in QTYPES
    assert block_format("Q6_K").block_bytes == 210 and block_format("q4_k").block_values == 256
    assert row_bytes(512, "q4_k") == 288
    with pytest.raises(QuantFormatError, match="read only"):
        quantize(torch.zeros(2, 256).numpy(), "q6_k")
