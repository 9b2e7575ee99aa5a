"""The formats Strata reads from llama.cpp's files and never writes: runtime.formats.kquants (Q6_K, Q5_K, Q4_K,
Q3_K, Q2_K) and runtime.formats.iquants (IQ4_XS, IQ4_NL), dequantized bit for bit as gguf-py's reference does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.errors import QuantFormatError
from runtime.formats import blocks, iquants, kquants
from runtime.formats.quant_linear import QuantLinear
from runtime.formats.registry import FORMATS, QTYPES, block_format, row_bytes

KQ = ("q6_k", "q4_k", "q5_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl")
BB = {"q6_k": 210, "q4_k": 144, "q5_k": 176, "q3_k": 110, "q2_k": 84, "iq4_xs": 136, "iq4_nl": 18}
VALS = {q: 32 if q == "iq4_nl" else 256 for q in KQ}       # values a block
# byte offsets of each format's f16 scale fields: d (and dmin)
F16_AT = {"q6_k": (208,), "q4_k": (0, 2), "q5_k": (0, 2), "q3_k": (108,), "q2_k": (80, 82), "iq4_xs": (0,),
          "iq4_nl": (0,)}
# f16 bit patterns a scale may take: zero, -0, smallest subnormal, largest subnormal, 1, max finite, inf, -inf, NaN
EDGE_F16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00]


def _ref(data: np.ndarray, q: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf_dequantize(data, GGMLQuantizationType[q.upper()])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, except that any NaN equals any NaN (its payload is the hardware's, not the format's)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32)))


def _edge_blocks(q: str, raw: np.ndarray, picks: list[int]) -> np.ndarray:
    """Put edge f16 values into the scale fields of each block (d, and dmin where the format has one)."""
    raw = raw.copy()
    for i, p in enumerate(picks):
        blk = raw[i % raw.shape[0]]
        v = np.array([EDGE_F16[p % len(EDGE_F16)]], np.uint16).view(np.uint8)
        at = F16_AT[q][i % len(F16_AT[q])]
        blk[at:at + 2] = v
    return raw


@pytest.mark.parametrize("q", KQ)
def test_table_rows_are_gguf_constants(q):
    f = FORMATS[q]
    assert f.ggml == GGMLQuantizationType[q.upper()]
    assert (f.block_values, f.block_bytes) == (VALS[q], BB[q])
    assert not f.writable and not f.offered
    assert q not in QTYPES


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(q=st.sampled_from(KQ), nblk=st.integers(1, 6), rows=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       picks=st.lists(st.integers(0, 50), max_size=8))
def test_random_blocks_bit_exact(q, nblk, rows, seed, picks):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * nblk, BB[q]), dtype=np.uint8)
    if picks:
        raw = _edge_blocks(q, raw, picks)
    else:   # most random f16 patterns are ordinary numbers; keep a realistic scale so products stay finite
        d = (rng.standard_normal(rows * nblk) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, F16_AT[q][0]:F16_AT[q][0] + 2] = d
    data = raw.reshape(rows, nblk * BB[q])
    ref = _ref(data, q)
    assert ref.shape == (rows, nblk * VALS[q])
    got_t = blocks.dequantize_torch(torch.from_numpy(data.copy()), q).numpy()
    assert _same_bits(got_t, ref)
    assert _same_bits(blocks.dequantize(data, q), ref)


@pytest.mark.parametrize("q", KQ)
def test_every_code_and_scale_byte(q):
    """Each code position and each scale byte value is decoded as the reference does (structured sweep)."""
    n = 256
    raw = np.zeros((n, BB[q]), np.uint8)
    for v in range(n):
        raw[v, :] = v                     # every byte of block v is v: all nibble/bit patterns, all 6-bit scales
        for at, f in zip(F16_AT[q], (0x3C00, 0x3800), strict=False):      # d = 1, dmin = 0.5
            raw[v, at:at + 2] = np.array([f], np.uint16).view(np.uint8)
    ref = _ref(raw, q)
    got = blocks.dequantize_torch(torch.from_numpy(raw), q).numpy()
    assert _same_bits(got, ref)


def test_they_are_read_only():
    x = np.zeros((1, 256), np.float32)
    for q in KQ:
        with pytest.raises(QuantFormatError, match="does not write"):
            blocks.quantize(x, q)
    with pytest.raises(QuantFormatError, match="not a K-quant"):
        kquants.dequantize_torch(torch.zeros(1, 34, dtype=torch.uint8), "q8_0")
    with pytest.raises(QuantFormatError, match="not an IQ4 format"):
        iquants.dequantize_torch(torch.zeros(1, 34, dtype=torch.uint8), "q8_0")
    with pytest.raises(QuantFormatError, match="not a whole number"):
        blocks.dequantize_torch(torch.zeros(1, 200, dtype=torch.uint8), "q6_k")


@pytest.mark.parametrize("q", KQ)
def test_quant_linear_reads_their_blocks(q):
    rng = np.random.default_rng(3)
    nb = 512 // VALS[q]
    raw = rng.integers(0, 256, size=(4, nb * BB[q]), dtype=np.uint8)
    for r in range(4):
        for b in range(nb):
            blk = raw[r, b * BB[q]:(b + 1) * BB[q]]
            for at in F16_AT[q]:
                blk[at:at + 2] = 0x20                                    # small finite scales
    lin = QuantLinear.from_blocks(raw, q, 512)
    assert lin.blocks.shape == (4, row_bytes(512, block_format(q).name))
    x = torch.randn(3, 512)
    w = torch.from_numpy(_ref(raw, q))
    torch.testing.assert_close(lin(x), x @ w.T, rtol=0, atol=0)
