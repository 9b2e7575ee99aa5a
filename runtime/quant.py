"""Block formats Q8_0 / Q5_0 / Q4_0 and BF16: quantize (numpy), dequantize (numpy and torch), QuantLinear.

`quantize` is byte-identical to `gguf.quants.quantize` (the port of ggml's reference rounding) on the same float32
input, and faster: it works on cache-sized chunks with reused work buffers, lets torch do the passes over all values
(vectorised reductions along the 32-value block and broadcasts, which numpy runs as slow short inner loops),
replaces the per-block `argmax` by a max/min pair (falling back to the exact argmax only for blocks whose two ends
tie), and rounds half away from zero with one add and a truncating cast. Blocks the fast path cannot reproduce bit
for bit (non-finite values, scales so small that `1/d` overflows) go through `_reference_blocks`, a line-by-line
port of gguf-py. Every float32 operation is the one gguf-py does, in the same order; the tests check the bytes.

Layouts (ggml): Q8_0 = f16 d + 32 x int8; Q5_0 = f16 d + u32 high bits + 16 nibble bytes; Q4_0 = f16 d + 16 nibble
bytes (element j in the low nibble of byte j, element j+16 in the high nibble).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

QTYPES: tuple[str, ...] = ("bf16", "q8_0", "q5_0", "q4_0")
GGML_TYPE: dict[str, int] = {"bf16": 30, "q8_0": 8, "q5_0": 6, "q4_0": 2}
FILE_TYPE: dict[str, int] = {"bf16": 32, "q8_0": 7, "q5_0": 8, "q4_0": 2}
BLOCK = 32
TYPE_SIZE: dict[str, int] = {"q8_0": 34, "q5_0": 22, "q4_0": 18}

# nextafter(0.5, 0) in float32: floor(a + HALF_DOWN) == round-half-away(a) for 0 <= a < 2**22 (checked
# exhaustively in the tests), and the truncating cast to int8 gives the floor for both signs once the sign is copied.
_HALF_DOWN = np.float32(np.nextafter(np.float32(0.5), np.float32(0.0)))


class QuantFormatError(ValueError):
    """The input cannot be stored in the requested block format (unknown type, row not a multiple of 32)."""


def _check_qtype(qtype: str) -> str:
    q = str(qtype).lower()
    if q not in QTYPES:
        raise QuantFormatError(f"unknown quantization {qtype!r}; use one of {', '.join(QTYPES)}")
    return q


def row_bytes(cols: int, qtype: str) -> int:
    """Bytes one row of `cols` values takes in `qtype`."""
    q = _check_qtype(qtype)
    if q == "bf16":
        return cols * 2
    if cols % BLOCK:
        raise QuantFormatError(f"row length {cols} is not a multiple of {BLOCK}, so it cannot be stored as {q}")
    return cols // BLOCK * TYPE_SIZE[q]


def cols_from_row_bytes(nbytes: int, qtype: str) -> int:
    """Inverse of `row_bytes`."""
    q = _check_qtype(qtype)
    if q == "bf16":
        return nbytes // 2
    if nbytes % TYPE_SIZE[q]:
        raise QuantFormatError(f"{nbytes} bytes per row is not a whole number of {q} blocks")
    return nbytes // TYPE_SIZE[q] * BLOCK


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

# Blocks per chunk: 8192 x 32 values = 1 MiB of float32, so a chunk and its work buffers stay in L2 between passes.
_CHUNK_BLOCKS = 8192


def _fix_ties(b: np.ndarray, m: np.ndarray, tie: np.ndarray) -> None:
    """Where max == -min the signed extreme is whichever comes first in the block (argmax semantics)."""
    idx = np.flatnonzero(tie)
    tb = b[idx]
    m[idx] = np.take_along_axis(tb, np.abs(tb).argmax(axis=1)[:, None], axis=1)[:, 0]


def _quantize_chunk(b: np.ndarray, out: np.ndarray, q: str, work: dict[str, torch.Tensor],
                    tb: torch.Tensor | None = None) -> None:
    """Quantize blocks `b` [nb, 32] float32 into `out` [nb, type_size] uint8 (a view into the result).

    The same float32 operations, in the same order, as gguf-py. torch does the passes over all values (its
    reductions along a short last axis and its broadcasts are vectorised, numpy's are not); numpy does the
    per-block scalars (1/32 of the data)."""
    nb = b.shape[0]
    tb = torch.from_numpy(b) if tb is None else tb
    tout = torch.from_numpy(out)
    v = work["v"][:nb]
    with np.errstate(all="ignore"):
        mx = torch.amax(tb, dim=1).numpy()
        mn = torch.amin(tb, dim=1).numpy()
        neg = -mn
        if q == "q8_0":
            d = np.abs(np.maximum(mx, neg)) / np.float32(127)  # abs: +0 for all-zero blocks, as gguf-py
        else:
            m = np.where(neg > mx, mn, mx)
            tie = neg == mx  # both ends equally large (incl. all-zero blocks): the first one wins, as argmax does
            if tie.any():
                _fix_ties(b, m, tie)
            d = m / np.float32(-8 if q == "q4_0" else -16)
        id_ = np.where(d == 0, np.float32(0), np.float32(1) / d)
    torch.mul(tb, torch.from_numpy(id_)[:, None], out=v)
    if q == "q8_0":
        # round half away from zero: add 0.49999997 carrying the value's sign; the cast then truncates
        s = work["s"][:nb]
        torch.copysign(work["h"], v, out=s)
        v.add_(s)
        tout[:, 2:].view(torch.int8).copy_(v)
    else:
        bias, top = (8.5, 15) if q == "q4_0" else (16.5, 31)
        v.add_(bias)  # v >= 0 from here on, so the cast below truncates exactly like np.trunc
        qv = work["q"][:nb]
        qv.copy_(v)
        qv.clamp_(max=top)
        q3 = qv.view(nb, 2, 16)
        if q == "q4_0":
            torch.add(q3[:, 0], q3[:, 1], alpha=16, out=tout[:, 2:])  # lo | hi << 4 (both <= 15)
        else:
            out[:, 2:6] = np.packbits(qv.numpy() >> 4, axis=-1, bitorder="little")
            qv.bitwise_and_(0x0F)
            torch.add(q3[:, 0], q3[:, 1], alpha=16, out=tout[:, 6:])
    tout[:, :2].copy_(torch.from_numpy(d).to(torch.float16).view(torch.uint8).view(nb, 2))  # huge d -> inf, as gguf-py
    if not np.isfinite(id_).all():
        bad = ~np.isfinite(id_)
        idx = np.flatnonzero(bad)
        out[idx] = _reference_blocks(np.ascontiguousarray(b[idx]), q)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] (or any shape with the row last) -> uint8 [rows, row_bytes], as gguf-py writes it.

    Byte-identical to `gguf.quants.quantize(x, GGMLQuantizationType[qtype.upper()])`. Works in chunks of 8192
    blocks with reused work buffers (a few MiB whatever the tensor size), the rows split over up to 4 worker
    threads. Each worker runs torch on one intra-op thread: OpenMP's spinning teams collapse when the machine is
    shared, and one thread per chunk keeps it in one core's cache. Rows not a multiple of 32 raise
    `QuantFormatError`.
    """
    q = _check_qtype(qtype)
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
    q = _check_qtype(qtype)
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
    """Worker threads: STRATA_QUANT_THREADS, else the CPU count (at most 4)."""
    env = os.environ.get("STRATA_QUANT_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(4, os.cpu_count() or 1))


def _pool() -> ThreadPoolExecutor:
    """Worker threads for `_quantize_span`."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(4, _workers()), thread_name_prefix="strata-quant")
        return _POOL


def _quantize_span(blocks: np.ndarray, oblocks: np.ndarray, q: str, bf16: bool) -> None:
    """One worker's share: its chunks in order, with its own work buffers, torch on one intra-op thread.

    `torch.get_num_threads()` first runs this thread's lazy OpenMP set-up; the old count is put back after, which
    also restores torch's process-wide default that `set_num_threads` touches (threads started later read it)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _quantize_span_1(blocks, oblocks, q, bf16)
    finally:
        torch.set_num_threads(prev)


def _quantize_span_1(blocks: np.ndarray, oblocks: np.ndarray, q: str, bf16: bool) -> None:
    nb = blocks.shape[0]
    step = min(nb, _CHUNK_BLOCKS)
    work = {"v": torch.empty(step, BLOCK), "s": torch.empty(step, BLOCK), "h": torch.tensor(float(_HALF_DOWN)),
            "q": torch.empty(step, BLOCK, dtype=torch.uint8)}
    if bf16:
        work["x"] = torch.empty(step, BLOCK)
    with torch.inference_mode():
        for s in range(0, nb, step):
            chunk = blocks[s:s + step]
            if bf16:
                xb = work["x"][:chunk.shape[0]]
                xb.copy_(torch.from_numpy(chunk).view(torch.bfloat16))  # exact widening, inside the cache
                _quantize_chunk(xb.numpy(), oblocks[s:s + step], q, work, xb)
            else:
                _quantize_chunk(chunk, oblocks[s:s + step], q, work)


def _quantize_rows(x: np.ndarray, q: str, *, bf16: bool) -> np.ndarray:
    cols = x.shape[-1]
    lead = x.shape[:-1]
    rb = row_bytes(cols, q)
    x2 = x.reshape(-1, cols)
    out = np.empty((x2.shape[0], rb), dtype=np.uint8)
    if out.size == 0:
        return out.reshape(*lead, rb)
    blocks = x2.reshape(-1, BLOCK)
    oblocks = out.reshape(-1, TYPE_SIZE[q])
    nb = blocks.shape[0]
    n = min(_workers(), -(-nb // _CHUNK_BLOCKS))
    if n > 1:  # contiguous shares, one per worker; torch and the big numpy loops release the GIL
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
    raw = np.ascontiguousarray(blocks).view(np.uint8)
    rb = raw.shape[-1]
    lead = raw.shape[:-1]
    cols = cols_from_row_bytes(rb, q)
    if q == "bf16":
        res = bf16_bits_to_f32(raw.reshape(-1, rb).view(np.uint16))
    else:
        b = raw.reshape(-1, TYPE_SIZE[q])
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
    if blocks.dtype != torch.uint8:
        raise QuantFormatError(f"blocks must be uint8, got {blocks.dtype}")
    rows, rb = blocks.shape
    cols = cols_from_row_bytes(rb, q)
    if q == "bf16":
        return blocks.contiguous().view(torch.bfloat16).float()
    b = blocks.reshape(rows, -1, TYPE_SIZE[q])
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


# ---------------------------------------------------------------------------------------------------- QuantLinear

class QuantLinear(nn.Module):
    """A linear layer whose weight lives as ggml blocks in a uint8 buffer; dequantized on the fly per call."""

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.qtype = _check_qtype(qtype)
        self.in_features = in_features
        self.out_features = out_features
        rb = row_bytes(in_features, self.qtype)
        self.register_buffer("blocks", torch.zeros(out_features, rb, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor | np.ndarray, qtype: str, in_features: int) -> QuantLinear:
        """Wrap existing blocks [out, row_bytes] (e.g. read from a GGUF file) without a float copy."""
        t = torch.as_tensor(np.ascontiguousarray(blocks)) if isinstance(blocks, np.ndarray) else blocks
        mod = cls(in_features, t.shape[0], qtype, device="meta")
        if tuple(t.shape) != (t.shape[0], row_bytes(in_features, qtype)):
            raise QuantFormatError(f"blocks shape {tuple(t.shape)} does not hold rows of {in_features} {qtype} values")
        mod.blocks = t.to(torch.uint8)
        return mod

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: str) -> QuantLinear:
        """Quantize a float weight [out, in] (through `quantize`, so the bytes match gguf-py)."""
        w = weight.detach().to(torch.float32).cpu().numpy()
        return cls.from_blocks(quantize(w, qtype), qtype, w.shape[1]).to(weight.device)

    @property
    def weight_nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_torch(self.blocks, self.qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.qtype != "bf16":
            from runtime import kernels

            if kernels.available(x):   # dequantized in registers: no float copy of the matrix, one launch
                y = kernels.quant_linear(x, self.blocks, self.qtype, self.in_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"
