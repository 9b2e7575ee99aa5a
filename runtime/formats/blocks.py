"""Block formats Q8_0 / Q5_0 / Q4_0 and BF16: quantize (numpy) and dequantize (numpy and torch).

The table of formats is runtime/formats/registry.py; adding a writable format means a row there, its
quantize/dequantize functions here and a Triton dequantizer in runtime/gpu/kernels.py for the fast path.

`quantize` / `quantize_bf16` are byte-identical to `gguf.quants.quantize` (the port of ggml's reference rounding)
on the same float32 input, and several times faster: every float32 operation is the one gguf-py does, in the same
order, but laid out so that each numpy pass runs over long contiguous rows instead of a short loop per 32-value
block (see "fast path" below). Blocks the fast formulas might not reproduce bit for bit (non-finite values, all-zero
blocks, scales whose reciprocal is subnormal or infinite) go through `_reference_blocks`, a line-by-line port of
gguf-py. The tests check the bytes against gguf-py itself. Layouts byte by byte: docs/formats.md, "Block formats".
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from runtime.errors import QuantFormatError
from runtime.formats import iquants, kquants
from runtime.formats.registry import (  # noqa: F401  (the table's names, for callers that quantize)
    BLOCK,
    FORMATS,
    QTYPES,
    BlockFormat,
    _check_qtype,
    block_format,
    by_tensor_type,
    cols_from_row_bytes,
    row_bytes,
    writable_format,
)

# nextafter(0.5, 0) in float32: floor(a + HALF_DOWN) == round-half-away(a) for 0 <= a < 2**22 (checked
# exhaustively in the tests), and the truncating cast to int8 gives the floor for both signs once the sign is copied.
_HALF_DOWN = np.float32(np.nextafter(np.float32(0.5), np.float32(0.0)))


# ---------------------------------------------------------------------------------------------------- BF16 helpers

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even, NaN kept quiet (as ggml / gguf-py do)."""
    n = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    n = np.where((n & 0x7FFFFFFF) > 0x7F800000, (n & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), n)
    n = (n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16
    return n.astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16, or any 2-byte view) -> float32, exact."""
    b = np.ascontiguousarray(bits).view(np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def bf16_bits_to_torch(bits: np.ndarray) -> torch.Tensor:
    """bf16 bits (uint16 numpy) -> torch.bfloat16 tensor sharing no memory with the input."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16).copy()).view(torch.bfloat16)


# ------------------------------------------------------------------------------------------- reference (gguf-py port)

def _np_roundf(n: np.ndarray) -> np.ndarray:
    a = abs(n)
    floored = np.floor(a)
    b = floored + np.floor(2 * (a - floored))
    return np.sign(n) * b


def _reference_blocks(blocks: np.ndarray, q: str) -> np.ndarray:
    """gguf-py's quantize_blocks, op for op, for the blocks the fast path must not guess at."""
    n_blocks = blocks.shape[0]
    with np.errstate(all="ignore"):
        if q == "q8_0":
            d = abs(blocks).max(axis=1, keepdims=True) / 127
            id_ = np.where(d == 0, 0, 1 / d)
            qs = _np_roundf(blocks * id_)
            return np.concatenate([d.astype(np.float16).view(np.uint8), qs.astype(np.int8).view(np.uint8)], axis=1)
        imax = abs(blocks).argmax(axis=-1, keepdims=True)
        mx = np.take_along_axis(blocks, imax, axis=-1)
        if q == "q4_0":
            d = mx / -8
            id_ = np.where(d == 0, 0, 1 / d)
            qs = np.trunc((blocks * id_) + np.float32(8.5), dtype=np.float32).astype(np.uint8).clip(0, 15)
            qs = qs.reshape((n_blocks, 2, 16))
            qs = qs[..., 0, :] | (qs[..., 1, :] << np.uint8(4))
            return np.concatenate([d.astype(np.float16).view(np.uint8), qs], axis=-1)
        d = mx / -16
        id_ = np.where(d == 0, 0, 1 / d)
        qv = np.trunc((blocks * id_) + np.float32(16.5), dtype=np.float32).astype(np.uint8).clip(0, 31)
        qs = qv.reshape((n_blocks, 2, 16))
        qs = (qs[..., 0, :] & np.uint8(0x0F)) | (qs[..., 1, :] << np.uint8(4))
        qh = np.packbits(qv.reshape((n_blocks, 1, 32)) >> np.uint8(4), axis=-1, bitorder="little").reshape(n_blocks, 4)
        return np.concatenate([d.astype(np.float16).view(np.uint8), qh, qs], axis=-1)


# ------------------------------------------------------------------------------------------------------- fast path
#
# gguf-py (and a naive port) works on [blocks, 32] arrays: every pass is a loop of 32 values per block, and numpy and
# torch both pay a fixed cost per such short row (the block max, the per-block scale broadcast, the nibble pairs),
# which dominates. Here each chunk is first transposed in units of 8 values (16 bytes of BF16, 32 of float32) into 4
# long rows: row k holds values 8k..8k+7 of every block, block after block ([4, 8n] for n blocks). Every pass then
# runs over long contiguous rows, in numpy only (mixing in torch ops measured slower: each switch costs):
# - block max / min: elementwise max over the 4 rows, then three halvings over 8 neighbours (strided, still flat);
#   on BF16 bits directly (int16 order = float order for >= 0; uint16 order finds the largest negative);
# - Q4_0/Q5_0 take the larger end m by the sign of max + min (a bit select), and 1/d as div/m (exact: d = m/div is
#   a power-of-two division, so it is exact for |m| >= _MIN_M and 1/d == div/m has the same single rounding);
# - the block scale, repeated 8 times, multiplies all 4 rows at once (numpy broadcasts over rows, not within them);
#   BF16 is widened to float32 inside the chunk (zero-extend, shift), so the weights are read from memory once;
# - Q8_0 rounds half away from zero as sign(x) * trunc(|x| * id + 0.49999997) (== gguf-py's np_roundf, see
#   `_HALF_DOWN`), the sign put back with (q ^ s) - s on int8;
# - values j and j+16 sit in rows k and k+2 at the same place, so nibble packing is two 64-bit ops on 8 values at a
#   time, and Q5_0's high bits are one 64-bit multiply per 8 values (row k gives qh byte k);
# - the packed blocks go back into the [n, type_size] rows with one strided copy of 8-, 16- or 20-byte units.
# Blocks whose largest positive and negative values tie (gguf-py's argmax picks the first; about 0.6% of the blocks
# of real BF16 weights) are written as if the positive end came first, then `_fix_ties` redoes the others.

_CHUNK_BLOCKS = 8192  # [4, 8 x 8192] float32 work rows = 1 MiB: a chunk's buffers stay in a core's L2
_DIV = {"q4_0": np.float32(-8), "q5_0": np.float32(-16)}
_BIAS = {"q4_0": np.float32(8.5), "q5_0": np.float32(16.5)}
_TOP = {"q4_0": 15, "q5_0": 31}
# |m| at least this: d = m / div is a normal float32, so d is exact and 1/d == div/m (one rounding, as gguf-py's)
_MIN_M = {"q4_0": np.float32(2.0 ** -123), "q5_0": np.float32(2.0 ** -122)}
_U4 = np.uint64(4)
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_BIT4S = np.uint64(0x1010101010101010)
_GATHER_BIT4S = np.uint64(0x0010204081020408)  # (w & _BIT4S) * this: bit 56 + t = bit 4 of byte t of w


class _Work:
    """One worker's chunk buffers (reused across chunks, so nothing is allocated per chunk)."""

    def __init__(self, step: int, bf16: bool) -> None:
        self.unit = np.dtype("V16") if bf16 else np.dtype("V32")  # 8 values
        self.t = np.empty((4, step), self.unit)
        self.v = np.empty((4, 8 * step), np.float32)
        self.q = np.empty((4, 8 * step), np.int8)
        self._top: dict[str, np.ndarray] = {}
        self.a = np.empty((4, 8 * step), np.int16 if bf16 else np.float32)  # Q8_0: |x|
        self.m = np.empty((4, 8 * step), np.int8)  # Q8_0: sign masks
        rdt = np.int16 if bf16 else np.float32
        self.r = np.empty((2, 8 * step), rdt)
        self.f1 = np.empty((2, 4 * step), rdt)
        self.f2 = np.empty((2, 2 * step), rdt)
        self.f3 = np.empty((2, step), rdt)
        self.rep = np.empty(8 * step, np.float32)
        self.inv = np.empty(step, np.float32)
        self.mask = np.empty(step, np.int32)
        self.p = np.empty((step, 3), np.uint64)
        self.p2 = np.empty((step, 2), np.uint64)
        self.h = np.empty((4, step), np.uint64)

    def top(self, q: str) -> np.ndarray:
        """The largest code of `q`, as an array shaped like `self.q`."""
        if q not in self._top:
            self._top[q] = np.full(self.q.shape, _TOP[q], np.int8)
        return self._top[q]


_LOCAL = threading.local()


def _work(bf16: bool) -> _Work:
    """This thread's chunk buffers (a few MiB), kept between calls: a converter quantizes dozens of tensors, and
    fresh buffers would page-fault in again every time."""
    cache = getattr(_LOCAL, "work", None)
    if cache is None:
        cache = _LOCAL.work = {}
    w = cache.get(bf16)
    if w is None or w.q.shape[1] != 8 * _CHUNK_BLOCKS:
        w = cache[bf16] = _Work(_CHUNK_BLOCKS, bf16)
    return w


def _fold8(r: np.ndarray, w: _Work, n: int, op: np.ufunc = np.maximum) -> np.ndarray:
    """[k, 8n] -> [k, n]: `op` over each run of 8 neighbours (one block's values in one row)."""
    k = r.shape[0]
    a, b, c = w.f1[:k, :4 * n], w.f2[:k, :2 * n], w.f3[:k, :n]
    op(r[:, 0::2], r[:, 1::2], out=a)
    op(a[:, 0::2], a[:, 1::2], out=b)
    op(b[:, 0::2], b[:, 1::2], out=c)
    return c


def _widen_rows(x: np.ndarray, w: _Work, n: int, bf16: bool) -> np.ndarray:
    """The float32 values of x (BF16 bits or float32) in the work rows."""
    v = w.v[:, :8 * n]
    if bf16:
        vi = v.view(np.uint32)
        np.copyto(vi, x.view(np.uint16))  # zero-extend, then move the bits up: exact
        np.left_shift(vi, 16, out=vi)
    else:
        np.copyto(v, x)
    return v


def _repeat8(vals: np.ndarray, w: _Work, n: int) -> np.ndarray:
    rep = w.rep[:8 * n]
    np.copyto(rep.reshape(n, 8), vals[:, None])
    return rep


def _q8_chunk(x: np.ndarray, w: _Work, n: int, bf16: bool, amax: np.ndarray, d: np.ndarray,
              inv: np.ndarray, qs8: np.ndarray) -> None:
    """Q8_0 of one chunk: q = sign(x) * floor(|x| * id + 0.49999997) (== gguf-py's round half away from zero)."""
    a = w.a[:, :8 * n]
    if bf16:
        np.bitwise_and(x, 0x7FFF, out=a)
    else:
        np.bitwise_and(x.view(np.int32), 0x7FFFFFFF, out=a.view(np.int32))
    r = w.r[:1, :8 * n]
    np.maximum.reduce(a, axis=0, out=r[0])
    f = _fold8(r, w, n)[0]
    if bf16:
        np.left_shift(f.view(np.uint16), 16, out=amax.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(amax, f)
    np.divide(amax, np.float32(127), out=d)
    np.divide(np.float32(1), d, out=inv)
    v = _widen_rows(a, w, n, bf16)
    np.multiply(v, _repeat8(inv, w, n), out=v)
    np.add(v, _HALF_DOWN, out=v)
    q = w.q[:, :8 * n]
    np.copyto(q, v, casting="unsafe")  # truncating cast; 0..127
    sgn = w.m[:, :8 * n]
    if bf16:
        np.right_shift(x, 15, out=sgn, casting="unsafe")  # 0 or -1
    else:
        np.right_shift(x.view(np.int32), 31, out=sgn, casting="unsafe")
    np.bitwise_xor(q, sgn, out=q)
    np.subtract(q, sgn, out=q)  # (q ^ s) - s: negated where s == -1
    np.copyto(qs8, q.view("V8").T)


def _q45_chunk(x: np.ndarray, w: _Work, n: int, q: str, bf16: bool, ext: np.ndarray, c: np.ndarray,
               m: np.ndarray, ob: np.ndarray) -> None:
    """Q4_0 / Q5_0 of one chunk. ext [2, n] gets (max, min) per block, c = max + min, m = the larger end (ties and
    other doubtful blocks are redone later)."""
    r = w.r[:, :8 * n]
    if bf16:
        np.maximum.reduce(x, axis=0, out=r[0])  # int16 order: the largest positive (else the largest negative)
        np.maximum.reduce(x.view(np.uint16), axis=0, out=r[1].view(np.uint16))  # the largest negative (else positive)
        np.bitwise_xor(r[1], np.int16(-32768), out=r[1])  # uint16 order -> int16 order, so one fold serves both
        f = _fold8(r, w, n)
        np.left_shift(f.view(np.uint16), 16, out=ext.view(np.uint32), dtype=np.uint32)
        np.bitwise_xor(ext[1].view(np.uint32), np.uint32(0x80000000), out=ext[1].view(np.uint32))
    else:
        np.maximum.reduce(x, axis=0, out=r[0])
        np.minimum.reduce(x, axis=0, out=r[1])
        np.copyto(ext[0], _fold8(r[:1], w, n)[0])
        np.copyto(ext[1], _fold8(r[1:], w, n, np.minimum)[0])
    np.add(ext[0], ext[1], out=c)
    # m = min if c < 0 else max, as a bit select: mask = c >> 31 (all ones when negative)
    mi, lo, hi = m.view(np.int32), ext[1].view(np.int32), ext[0].view(np.int32)
    mask = w.mask[:n]
    np.right_shift(c.view(np.int32), 31, out=mask)
    np.bitwise_xor(lo, hi, out=mi)
    np.bitwise_and(mi, mask, out=mi)
    np.bitwise_xor(mi, hi, out=mi)
    inv = np.divide(_DIV[q], m, out=w.inv[:n])
    v = _widen_rows(x, w, n, bf16)
    np.multiply(v, _repeat8(inv, w, n), out=v)
    np.add(v, _BIAS[q], out=v)
    qq = w.q[:, :8 * n]
    np.copyto(qq, v, casting="unsafe")  # truncating cast; v >= 0 here
    np.minimum(qq, w.top(q)[:, :8 * n], out=qq)  # (a full array: numpy's loop for a scalar operand is slow)
    u = qq.view(np.uint64)  # [4, n]: 8 values a word
    # p: a block's bytes after d, in words: Q4_0 [n, 2] the 16 nibble bytes; Q5_0 [n, 3] qh in bytes 4..7, then those
    p = w.p[:n] if q == "q5_0" else w.p2[:n]
    if q == "q5_0":
        h = w.h[:, :n]
        np.bitwise_and(u, _BIT4S, out=h)  # the high bit (bit 4) of each code
        np.multiply(h, _GATHER_BIT4S, out=h)  # row k's 8 high bits gathered in the top byte: qh byte k
        pb, hb = p.view(np.uint8), h.view(np.uint8)
        for k in range(4):  # one long strided copy per byte (a 2-D copy would loop over 4 bytes at a time)
            np.copyto(pb[:, 4 + k], hb[k, 7::8])
        np.bitwise_and(u, _LOW_NIBBLES, out=u)
    np.left_shift(u[2:4], _U4, out=u[2:4])
    np.bitwise_or(u[0:2], u[2:4], out=p[:, -2:].T)  # values j and j+16 share byte j
    unit = "V20" if q == "q5_0" else "V16"
    np.copyto(ob[:, 2:].view(unit)[:, 0], p.view(np.uint8)[:, p.shape[1] * 8 + 2 - ob.shape[1]:].view(unit)[:, 0])


def _quantize_span_1(blocks: np.ndarray, oblocks: np.ndarray, q: str, bf16: bool,
                     ties_ok: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Quantize `blocks` [nb, 32] (BF16 bits or float32) into `oblocks` [nb, type_size].

    Returns (bad, ties): bool masks of the blocks `_reference_blocks` must redo, and (Q4_0/Q5_0) of the tie blocks,
    written as if their positive end came first (`_fix_ties` checks that); `ties_ok` says that is known."""
    nb = blocks.shape[0]
    step = min(nb, _CHUNK_BLOCKS)
    w = _work(bf16)
    units = blocks.view(w.unit)  # [nb, 4]
    d = np.empty(nb, np.float32)
    ties = None
    with np.errstate(all="ignore"), torch.inference_mode():
        if q == "q8_0":
            amax, inv = np.empty(nb, np.float32), np.empty(nb, np.float32)
            qs8 = oblocks[:, 2:].view("V8")
            for s in range(0, nb, step):
                e = min(nb, s + step)
                t = w.t[:, :e - s]
                np.copyto(t, units[s:e].T)
                x = t.view(np.int16 if bf16 else np.float32)
                _q8_chunk(x, w, e - s, bf16, amax[s:e], d[s:e], inv[s:e], qs8[s:e])
            bad = ~np.isfinite(inv)
            bad |= ~np.isfinite(d)
        else:
            ext = np.empty((2, nb), np.float32)
            c, m = np.empty(nb, np.float32), np.empty(nb, np.float32)
            for s in range(0, nb, step):
                e = min(nb, s + step)
                t = w.t[:, :e - s]
                np.copyto(t, units[s:e].T)
                x = t.view(np.int16 if bf16 else np.float32)
                _q45_chunk(x, w, e - s, q, bf16, ext[:, s:e], c[s:e], m[s:e], oblocks[s:e])
            np.divide(m, _DIV[q], out=d)
            bad = ~np.isfinite(c)
            np.abs(m, out=m)
            bad |= ~(m >= _MIN_M[q])  # all-zero blocks, tiny or non-finite ends
            if not ties_ok:
                ties = c == 0  # both ends equally large: gguf-py's argmax takes the first
                ties &= ~bad
        # d -> float16 into each block's first two bytes (torch's conversion: same bits as numpy's for every finite
        # float32, overflow to inf included, and much faster; non-finite d are redone anyway)
        d16 = torch.from_numpy(d).to(torch.float16).numpy().view(np.uint16)
        np.copyto(oblocks[:, :2].view(np.uint16)[:, 0], d16)
    return bad, ties


def _fix_ties(blocks: np.ndarray, oblocks: np.ndarray, ties: np.ndarray, bad: np.ndarray, q: str, bf16: bool) -> None:
    """Blocks whose largest positive and negative values are equally large were written with the positive one as
    the scale's sign; gguf-py uses the one that comes first. Where that is the negative one, quantize the negated
    block (the same codes: (-x) * (-id) == x * id exactly) and flip the sign of its d. (About 0.6% of the blocks
    of real BF16 weights tie; this costs a fraction of redoing them with the reference.)"""
    idx = np.flatnonzero(ties)
    if not idx.size:
        return
    b = blocks[idx]  # [k, 32] BF16 bits or float32
    if bf16:
        mx = b.view(np.int16).max(axis=1, keepdims=True).view(np.uint16)  # the positive end's bits
        first_neg = (b == (mx | np.uint16(0x8000))).argmax(axis=1) < (b == mx).argmax(axis=1)
    else:
        mx = b.max(axis=1, keepdims=True)
        first_neg = (b == -mx).argmax(axis=1) < (b == mx).argmax(axis=1)
    if not first_neg.any():
        return
    idx = idx[first_neg]
    neg = blocks[idx] ^ np.uint16(0x8000) if bf16 else -blocks[idx]
    sub = np.empty((idx.size, oblocks.shape[1]), np.uint8)
    sub_bad, _ = _quantize_span_1(np.ascontiguousarray(neg), sub, q, bf16, ties_ok=True)
    sub[:, 1] ^= np.uint8(0x80)  # d's sign bit (float16, little-endian)
    oblocks[idx] = sub
    bad[idx[sub_bad]] = True  # none expected (same magnitudes as blocks that passed); the reference would decide


def _redo_blocks(blocks: np.ndarray, oblocks: np.ndarray, bad: np.ndarray, q: str, bf16: bool) -> None:
    """Recompute the marked blocks with the line-by-line port of gguf-py."""
    idx = np.flatnonzero(bad)
    if idx.size:
        b = blocks[idx]
        b = bf16_bits_to_f32(b) if bf16 else np.ascontiguousarray(b)
        oblocks[idx] = _reference_blocks(b, q)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] (or any shape with the row last) -> uint8 [rows, row_bytes], as gguf-py writes it.

    Byte-identical to `gguf.quants.quantize(x, GGMLQuantizationType[qtype.upper()])`. Works in chunks of 8192
    blocks with per-thread work buffers (a few MiB whatever the tensor size), the rows split over `_workers()`
    threads. Rows not a multiple of 32 raise `QuantFormatError`.
    """
    q = writable_format(qtype).name
    x = np.asarray(x)
    if x.ndim == 0:
        raise QuantFormatError("cannot quantize a scalar")
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    if q == "bf16":
        return f32_to_bf16_bits(x).view(np.uint8).reshape(*x.shape[:-1], row_bytes(x.shape[-1], q))
    return _quantize_rows(np.ascontiguousarray(x), q, bf16=False)


def quantize_bf16(bits: np.ndarray, qtype: str) -> np.ndarray:
    """Like `quantize(bf16_bits_to_f32(bits), qtype)`, byte for byte, straight from BF16 bits (uint16 [.., cols]).

    The converter's path: each chunk is widened to float32 inside the cache, so the weights are read from memory
    once at 2 bytes a value and no float32 copy of a whole tensor is ever made."""
    q = writable_format(qtype).name
    bits = np.ascontiguousarray(bits)
    if bits.dtype.itemsize != 2:
        raise QuantFormatError(f"BF16 bits must be a 2-byte dtype, got {bits.dtype}")
    bits = bits.view(np.uint16)
    if bits.ndim == 0:
        raise QuantFormatError("cannot quantize a scalar")
    if q == "bf16":
        return bits.view(np.uint8).reshape(*bits.shape[:-1], bits.shape[-1] * 2).copy()
    return _quantize_rows(bits, q, bf16=True)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _workers() -> int:
    """Worker threads: STRATA_QUANT_THREADS, else half the CPUs this process may run on (at most 4).

    Half: the passes are memory-bound, and a second thread on SMT siblings (or on the 2 vCPUs of a small VM, which
    measured like one core shared) only adds its overhead; on a 2-CPU machine the work stays on the calling thread."""
    env = os.environ.get("STRATA_QUANT_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // 2))


def _pool() -> ThreadPoolExecutor:
    """Worker threads for `_quantize_span`."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(4, _workers()), thread_name_prefix="strata-quant")
        return _POOL


def _quantize_span(blocks: np.ndarray, oblocks: np.ndarray, q: str, bf16: bool) -> None:
    """One worker's share: fast path chunk by chunk, then the reference for the blocks it marked.

    torch (only d's float16 conversion) runs on one intra-op thread here: the workers already share the cores.
    `torch.get_num_threads()` first runs this thread's lazy OpenMP set-up; the old count is put back after, which
    also restores torch's process-wide default that `set_num_threads` touches."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bad, ties = _quantize_span_1(blocks, oblocks, q, bf16)
        if ties is not None:
            _fix_ties(blocks, oblocks, ties, bad, q, bf16)
    finally:
        torch.set_num_threads(prev)
    _redo_blocks(blocks, oblocks, bad, q, bf16)


def _quantize_rows(x: np.ndarray, q: str, *, bf16: bool) -> np.ndarray:
    cols = x.shape[-1]
    lead = x.shape[:-1]
    rb = row_bytes(cols, q)
    x2 = x.reshape(-1, cols)
    out = np.empty((x2.shape[0], rb), dtype=np.uint8)
    if out.size == 0:
        return out.reshape(*lead, rb)
    blocks = x2.reshape(-1, BLOCK)
    oblocks = out.reshape(-1, FORMATS[q].block_bytes)
    nb = blocks.shape[0]
    n = min(_workers(), -(-nb // _CHUNK_BLOCKS))
    if n > 1:  # contiguous shares, one per worker; numpy's loops release the GIL
        cuts = [nb * i // n for i in range(n + 1)]
        futs = [_pool().submit(_quantize_span, blocks[a:b], oblocks[a:b], q, bf16) for a, b in zip(cuts, cuts[1:], strict=False)]
        for f in futs:
            f.result()
    else:
        _quantize_span(blocks, oblocks, q, bf16)
    return out.reshape(*lead, rb)


# ----------------------------------------------------------------------------------------------------- dequantize

def dequantize(blocks: np.ndarray, qtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """uint8 blocks [rows, row_bytes] -> float32 (reshaped to `shape` when given); same values as gguf-py."""
    q = _check_qtype(qtype)
    if q in kquants.KQUANTS or q in iquants.IQUANTS:
        res = (kquants if q in kquants.KQUANTS else iquants).dequantize(blocks, q)
        return res.reshape(shape) if shape is not None else res
    raw = np.ascontiguousarray(blocks).view(np.uint8)
    rb = raw.shape[-1]
    lead = raw.shape[:-1]
    cols = cols_from_row_bytes(rb, q)
    if q == "bf16":
        res = bf16_bits_to_f32(raw.reshape(-1, rb).view(np.uint16))
    else:
        b = raw.reshape(-1, FORMATS[q].block_bytes)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        if q == "q8_0":
            vals = b[:, 2:].view(np.int8).astype(np.float32)
        else:
            ql = b[:, -16:]
            lo = np.concatenate([ql & 0x0F, ql >> 4], axis=1)
            if q == "q4_0":
                vals = (lo.astype(np.int8) - np.int8(8)).astype(np.float32)
            else:
                qh = b[:, 2:6].copy().view("<u4")
                hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
                vals = ((lo | (hi << 4)).astype(np.int8) - np.int8(16)).astype(np.float32)
        res = d * vals
    res = res.reshape(*lead, cols)
    return res.reshape(shape) if shape is not None else res


def dequantize_torch(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 tensor [rows, row_bytes] -> float32 [rows, cols] on the same device (same values as `dequantize`)."""
    q = _check_qtype(qtype)
    if q in kquants.KQUANTS:
        return kquants.dequantize_torch(blocks, q)
    if q in iquants.IQUANTS:
        return iquants.dequantize_torch(blocks, q)
    if blocks.dtype != torch.uint8:
        raise QuantFormatError(f"blocks must be uint8, got {blocks.dtype}")
    rows, rb = blocks.shape
    cols = cols_from_row_bytes(rb, q)
    if q == "bf16":
        return blocks.contiguous().view(torch.bfloat16).float()
    b = blocks.reshape(rows, -1, FORMATS[q].block_bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if q == "q8_0":
        vals = b[..., 2:].contiguous().view(torch.int8).float()
    else:
        ql = b[..., -16:]
        lo = torch.cat([ql & 0x0F, ql >> 4], dim=-1)
        if q == "q4_0":
            vals = lo.float() - 8.0
        else:
            qh = b[..., 2:6].to(torch.int32)
            qh = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
            shifts = torch.arange(32, device=blocks.device, dtype=torch.int32)
            hi = ((qh[..., None] >> shifts) & 1).to(torch.uint8)
            vals = (lo | (hi << 4)).float() - 16.0
    return (d * vals).reshape(rows, cols)
