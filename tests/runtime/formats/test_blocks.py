"""runtime.formats.blocks: byte equality with gguf-py's reference quantizer, dequantization, QuantLinear."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from runtime.errors import QuantFormatError
from runtime.formats import blocks as quant
from runtime.formats.blocks import bf16_bits_to_f32, dequantize, dequantize_torch, f32_to_bf16_bits, quantize
from runtime.formats.quant_linear import QuantLinear

QS = ("q8_0", "q5_0", "q4_0")


def _ref(x: np.ndarray, q: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf_quantize(x, GGMLQuantizationType[q.upper()])


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def _check(x: np.ndarray, q: str) -> None:
    ours = quantize(x, q)
    ref = _ref(x, q)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    if not np.array_equal(ours, ref):
        bad = np.argwhere(ours != ref)[:5]
        raise AssertionError(f"{q}: bytes differ at {bad.tolist()}")
    bits = f32_to_bf16_bits(x)
    if np.array_equal(bf16_bits_to_f32(bits), x):  # BF16-representable: the converter's path must agree too
        assert np.array_equal(quant.quantize_bf16(bits, q), ref), f"{q}: quantize_bf16 differs"


@pytest.mark.parametrize("q", QS)
def test_realistic_matrix_many_chunks(q):
    rng = np.random.default_rng(1)
    x = _bf16(rng.standard_normal((96, 4096), dtype=np.float32) * 0.02)  # > several chunks, threaded path
    _check(x, q)


@pytest.mark.parametrize("q", QS)
def test_special_blocks(q):
    rows = []
    z = np.zeros(32, np.float32)
    rows.append(z)  # all zero
    nz = z.copy()
    nz[0] = -0.0
    rows.append(nz)  # negative zero first: the sign of d comes from the first element
    t = np.linspace(-1, 1, 32, dtype=np.float32)
    rows.append(t)  # tie: -1 first, +1 last
    rows.append(t[::-1].copy())  # tie: +1 first
    h = np.full(32, 0.5, np.float32)
    h[5] = -0.5
    rows.append(h)  # many ties at +-max
    rows.append(np.array([3.0, -3.0] * 16, np.float32))
    rows.append(np.full(32, 3.0e38, np.float32) * np.sign(np.arange(32) - 15.5).astype(np.float32))  # huge
    rows.append((np.arange(32, dtype=np.float32) - 16) * np.float32(1e-38))  # tiny: 1/d overflows
    rows.append((np.arange(32, dtype=np.float32) - 16) * np.float32(1e-44))  # subnormal
    rows.append(np.full(32, 1e-30, np.float32))
    # exact .5 steps after scaling: k/127 * amax with amax = 127 hits every half-integer tie for q8
    rows.append(np.float32(127) * np.ones(32, np.float32) * np.r_[1.0, np.arange(31) / 31].astype(np.float32))
    rows.append(np.r_[np.float32(127), (np.arange(31, dtype=np.float32) + np.float32(0.5))])
    rows.append(np.r_[np.float32(-16), (np.arange(31, dtype=np.float32) - np.float32(15.5))])
    x = np.stack(rows).astype(np.float32)
    _check(x, q)
    _check(np.tile(x, (1, 3)), q)


row_shapes = st.tuples(st.integers(1, 9), st.integers(1, 12).map(lambda n: n * 32))


@st.composite
def matrices(draw):
    shape = draw(row_shapes)
    scale = draw(st.sampled_from([1e-40, 1e-37, 1e-20, 1e-3, 0.02, 1.0, 1e4, 1e30, 3e38]))
    elems = st.floats(-1, 1, width=32, allow_nan=False, allow_infinity=False)
    x = draw(hnp.arrays(np.float32, shape, elements=elems))
    with np.errstate(all="ignore"):
        x = (x * np.float32(scale)).astype(np.float32)
    x[~np.isfinite(x)] = 0
    if draw(st.booleans()):  # plant ties at +-max and zero blocks
        blk = x.reshape(-1, 32)
        i = draw(st.integers(0, blk.shape[0] - 1))
        m = np.abs(blk[i]).max()
        blk[i, draw(st.integers(0, 31))] = -m
        blk[i, draw(st.integers(0, 31))] = m
        if draw(st.booleans()):
            blk[draw(st.integers(0, blk.shape[0] - 1))] = 0
    if draw(st.booleans()):
        x = _bf16(x)
    return x


@pytest.mark.parametrize("q", QS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=matrices())
def test_hypothesis_byte_equality(q, x):
    _check(x, q)


def test_half_down_rounding_exhaustive_near_ties():
    """floor(a + 0.49999997) == round-half-away(a): every float32 in the binades where it could go wrong."""
    for lo in (0.25, 0.5, 1.0, 64.0):
        a = np.arange(np.float32(lo).view(np.uint32), np.float32(lo * 2).view(np.uint32), dtype=np.uint32)
        a = a.view(np.float32)
        fast = np.floor(a + quant._HALF_DOWN)
        ref = np.floor(a) + np.floor(2 * (a - np.floor(a)))
        assert np.array_equal(fast, ref), lo


@pytest.mark.parametrize("q", QS)
def test_dequantize_matches_gguf_numpy_and_torch(q):
    rng = np.random.default_rng(2)
    x = _bf16(rng.standard_normal((8, 256), dtype=np.float32))
    blocks = quantize(x, q)
    ref = gguf_dequantize(blocks, GGMLQuantizationType[q.upper()])
    np.testing.assert_array_equal(dequantize(blocks, q), ref)
    np.testing.assert_array_equal(dequantize_torch(torch.from_numpy(blocks), q).numpy(), ref)
    err = np.abs(ref - x).max() / np.abs(x).max()
    assert err < {"q8_0": 0.01, "q5_0": 0.07, "q4_0": 0.14}[q]


def test_bf16_bits_match_gguf_and_roundtrip():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64), dtype=np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    ours = quantize(x, "bf16")
    ref = gguf_quantize(x, GGMLQuantizationType.BF16)
    assert np.array_equal(ours, ref)
    exact = _bf16(x[1:])
    assert np.array_equal(bf16_bits_to_f32(f32_to_bf16_bits(exact)), exact)
    t = dequantize_torch(torch.from_numpy(quantize(exact, "bf16")), "bf16")
    assert np.array_equal(t.numpy(), exact)


def test_row_not_multiple_of_32_is_refused():
    with pytest.raises(QuantFormatError, match="not a multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), "q4_0")
    with pytest.raises(QuantFormatError, match="unknown quantization"):
        quantize(np.zeros((2, 32), np.float32), "q3_x")
    with pytest.raises(QuantFormatError, match="q3_k is read only"):
        quantize(np.zeros((2, 256), np.float32), "q3_k")


@pytest.mark.parametrize("q", QS + ("bf16",))
def test_quantlinear_holds_blocks_and_matches_dequantized_weight(q):
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    lin = QuantLinear.from_float(w, q)
    assert lin.blocks.dtype == torch.uint8
    assert [n for n, _ in lin.named_parameters()] == []  # no float copy of the weight
    assert lin.weight_nbytes == 48 * quant.row_bytes(64, q)
    x = torch.randn(3, 64)
    wd = torch.from_numpy(dequantize(quantize(w.numpy(), q), q))
    torch.testing.assert_close(lin(x), x @ wd.T)
    y16 = lin(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    sd = lin.state_dict()
    lin2 = QuantLinear(64, 48, q)
    lin2.load_state_dict(sd)
    assert torch.equal(lin2.blocks, lin.blocks)


# ------------------------------------------------------------------ fast path internals: chunks, ties, odd inputs

def _edge_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """BF16 weights with planted ties (either end first), all-zero / -0 blocks and a few huge and tiny blocks."""
    x = _bf16(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
    blk = x.reshape(-1, 32)
    n = blk.shape[0]
    for i in rng.choice(n, size=n // 5, replace=False):  # ties at +-max, in random order
        m = np.abs(blk[i]).max()
        j, k = rng.choice(32, size=2, replace=False)
        blk[i, j], blk[i, k] = -m, m
    blk[rng.choice(n, size=3, replace=False)] = 0.0
    blk[rng.integers(n), 0] = -0.0
    blk[rng.integers(n)] *= np.float32(1e30)
    blk[rng.integers(n)] *= np.float32(1e-36)
    return x


@pytest.mark.parametrize("threads", ["1", "3"])
def test_many_small_chunks_ties_and_partial_chunks(q_all, threads, monkeypatch):
    """Chunks of 64 blocks (and a partial last one) per worker, ties in many chunks, buffers reused across calls."""
    monkeypatch.setattr(quant, "_CHUNK_BLOCKS", 64)
    monkeypatch.setenv("STRATA_QUANT_THREADS", threads)
    rng = np.random.default_rng(5)
    for rows, cols in ((37, 224), (3, 32), (130, 96)):
        _check(_edge_matrix(rng, rows, cols), q_all)


@pytest.fixture(params=QS)
def q_all(request):
    return request.param


def test_non_finite_blocks_are_redone_exactly(q_all):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 128), dtype=np.float32)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 70] = -np.inf
    x[3, :32] = np.inf
    x[3, 32:64] = -np.nan
    with np.errstate(all="ignore"):
        ref = _ref(x, q_all)
        ours = quantize(x, q_all)
    assert np.array_equal(ours, ref)
    bits = f32_to_bf16_bits(x)
    with np.errstate(all="ignore"):
        assert np.array_equal(quant.quantize_bf16(bits, q_all), _ref(bf16_bits_to_f32(bits), q_all))


def test_negative_end_first_ties_flip_only_the_sign_of_d():
    """The tie repair path: -m before +m gives d < 0 (codes as for the negated block), +m first gives d > 0."""
    b = np.linspace(-0.5, 0.5, 32, dtype=np.float32)
    b[3], b[20] = -1.0, 1.0  # negative end first
    c = b.copy()
    c[3], c[20] = 1.0, -1.0  # positive end first
    x = np.stack([b, c, -b, -c])
    for q in ("q4_0", "q5_0"):
        ours = quantize(x, q)
        assert np.array_equal(ours, _ref(x, q))
        d = ours[:, :2].copy().view(np.float16)[:, 0]
        assert d[0] > 0 and d[1] < 0  # d = m / -8: m = -1 -> d > 0


def test_leading_dims_and_reuse_across_types():
    rng = np.random.default_rng(7)
    x = _bf16(rng.standard_normal((2, 3, 64), dtype=np.float32))
    for q in QS + QS[::-1]:
        ours = quantize(x, q)
        assert ours.shape == (2, 3, quant.row_bytes(64, q))
        assert np.array_equal(ours.reshape(6, -1), _ref(x.reshape(6, 64), q))
