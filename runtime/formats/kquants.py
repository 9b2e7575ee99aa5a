"""K-quant super-blocks Q6_K and Q4_K (docs/formats.md, "Block formats"): dequantization only.

Strata never writes K-quants; it reads them from the GGUF files llama.cpp's `llama-quantize` makes (the common
`Q4_K_M` mix stores most matrices as Q4_K and some as Q6_K). A super-block holds 256 values (`QK_K`).

numpy: gguf-py's own `gguf.quants.dequantize` (the reference, so there is nothing to get wrong). torch: the same
float32 operations in the same order, on any device, so the values are bit for bit gguf-py's (the tests compare the
bits on random blocks, edge scales included): Q6_K `(d * scale) * q`, Q4_K `(d * sc) * q - dmin * m`.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.errors import QuantFormatError
from runtime.formats.registry import FORMATS, block_format, cols_from_row_bytes

KQUANTS = ("q6_k", "q4_k")


def _check(qtype: str) -> str:
    q = block_format(qtype).name
    if q not in KQUANTS:
        raise QuantFormatError(f"{qtype!r} is not a K-quant; use one of {', '.join(KQUANTS)}.")
    return q


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 [..., row_bytes] -> float32 [..., cols], through gguf-py's reference."""
    from gguf.quants import dequantize as ref

    q = _check(qtype)
    raw = np.ascontiguousarray(blocks).view(np.uint8)
    cols_from_row_bytes(raw.shape[-1], q)   # a whole number of super-blocks, or one sentence
    with np.errstate(all="ignore"):          # inf/NaN scales decode to inf/NaN, as in ggml
        return ref(raw, FORMATS[q].ggml)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    lo = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 2, 128)          # value 64s + j of a half: nibble s of ql[j]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    hi = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, 2, 128)  # value 32s + l: bits 2s of qh[l]
    q = ((lo | (hi << 4)).to(torch.int16) - 32).float().reshape(n, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    return (d * q).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    sd, sm, smd = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)), dim=-1)
    mn = torch.cat((sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)), dim=-1)
    scale = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()   # sub-block 2i: low nibbles, 2i+1: high
    return (scale * q - dm).reshape(n, 256)


def dequantize_torch(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 tensor [rows, row_bytes] -> float32 [rows, cols] on the same device (gguf-py's values, bit for bit)."""
    q = _check(qtype)
    if blocks.dtype != torch.uint8:
        raise QuantFormatError(f"blocks must be uint8, got {blocks.dtype}")
    rows, rb = blocks.shape
    cols = cols_from_row_bytes(rb, q)
    b = blocks.reshape(-1, FORMATS[q].block_bytes)
    out = _q6_k(b) if q == "q6_k" else _q4_k(b)
    return out.reshape(rows, cols)
