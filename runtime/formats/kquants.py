"""K-quant super-blocks Q6_K, Q5_K, Q4_K, Q3_K and Q2_K (docs/formats.md, "Block formats"): dequantization only.

Strata never writes K-quants; it reads them from the GGUF files llama.cpp's `llama-quantize` makes (the common
`Q4_K_M` mix stores most matrices as Q4_K and some as Q6_K, `Q5_K_M` Q5_K and Q6_K, `Q4_K_S` Q4_K and some Q5_K;
`Q3_K_M` Q3_K with some Q4_K, Q5_K and Q6_K). A super-block holds 256 values (`QK_K`).

numpy: gguf-py's own `gguf.quants.dequantize` (the reference, so there is nothing to get wrong). torch: the same
float32 operations in the same order, on any device, so the values are bit for bit gguf-py's (the tests compare the
bits on random blocks, edge scales included): Q6_K and Q3_K `(d * scale) * q`, Q4_K, Q5_K and Q2_K
`(d * sc) * q - dmin * m`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from runtime.errors import QuantFormatError
from runtime.formats.registry import FORMATS, block_format, cols_from_row_bytes

KQUANTS = ("q6_k", "q4_k", "q5_k", "q3_k", "q2_k")


def checked(qtype: str, among: tuple[str, ...], what: str) -> str:
    """The name of format `qtype` when it is one of `among`, else one sentence (`what`: "a K-quant")."""
    q = block_format(qtype).name
    if q not in among:
        raise QuantFormatError(f"{qtype!r} is not {what}; use one of {', '.join(among)}.")
    return q


def _check(qtype: str) -> str:
    return checked(qtype, KQUANTS, "a K-quant")


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 [..., row_bytes] -> float32 [..., cols], through gguf-py's reference."""
    return reference(blocks, _check(qtype))


def reference(blocks: np.ndarray, q: str) -> np.ndarray:
    """gguf-py's dequantization of blocks of format q (a name) -> float32 [..., cols]."""
    from gguf.quants import dequantize as ref

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


def _scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight sub-blocks' d * sc and dmin * m [n, 8, 1] of Q4_K / Q5_K super-blocks (their first 16 bytes: d,
    dmin, twelve bytes of 6-bit scales and minimums, unpacked as ggml's get_scale_min_k4)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    sd, sm, smd = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)), dim=-1)
    mn = torch.cat((sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)), dim=-1)
    return (d * sc.float()).reshape(n, 8, 1), (dmin * mn.float()).reshape(n, 8, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 code bytes [n, 128] -> the 256 low 4 bits [n, 8, 32]: sub-block 2i the low nibbles of bytes 32i.., 2i+1
    their high nibbles."""
    qs = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    scale, dm = _scale_min(b)
    return (scale * _nibbles(b[:, 16:144]).float() - dm).reshape(b.shape[0], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout with 32 bytes qh between the scales and the nibbles: bit j of qh[l] is the fifth bit of
    sub-block j's value l."""
    n = b.shape[0]
    scale, dm = _scale_min(b)
    qh = b[:, 16:48].reshape(n, 1, 32)
    hi = torch.cat([(qh >> j) & 1 for j in range(8)], dim=1)                  # [n, 8, 32]: sub-block j, value l
    q = (_nibbles(b[:, 48:176]) | (hi << 4)).float()
    return (scale * q - dm).reshape(n, 256)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """64 code bytes [n, 64] -> the 256 2-bit codes [n, 16, 16] in value order: value 128h + 32t + l is bits 2t, 2t+1
    of qs[32h + l] (Q3_K's and Q2_K's low bits)."""
    qs = qs.reshape(qs.shape[0], 2, 1, 32)
    return torch.cat([(qs >> (2 * t)) & 3 for t in range(4)], dim=2).reshape(qs.shape[0], 16, 16)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask[32], qs[64], twelve bytes of 6-bit scales, d: value v = d * (scale - 32) * (crumb - 4 * (1 - bit
    v // 32 of hmask[v % 32]))."""
    n = b.shape[0]
    sc = b[:, 96:108]
    lo = torch.cat((sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4), dim=1)                 # sub-block s: byte s % 8, nibble s // 8
    hi = torch.cat([(sc[:, 8:12] >> (2 * t)) & 3 for t in range(4)], dim=1)    # bits 2 (s // 4) of byte 8 + s % 4
    scale = ((lo | (hi << 4)).to(torch.int16) - 32).float()
    dl = (_f16(b[:, 108:110]) * scale).reshape(n, 16, 1)
    hm = b[:, 0:32].reshape(n, 1, 32)
    hb = torch.cat([(hm >> j) & 1 for j in range(8)], dim=1).reshape(n, 16, 16)
    q = (_crumbs(b[:, 32:96]).to(torch.int16) - ((hb ^ 1).to(torch.int16) << 2)).float()
    return (dl * q).reshape(n, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales[16] (a 4-bit scale and a 4-bit minimum per sub-block of 16), qs[64], d, dmin."""
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = (_f16(b[:, 80:82]) * (sc & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(b[:, 82:84]) * (sc >> 4).float()).reshape(n, 16, 1)
    return (dl * _crumbs(b[:, 16:80]).float() - ml).reshape(n, 256)


def decode_rows(blocks: torch.Tensor, q: str, decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """uint8 rows [rows, row_bytes] of format q -> float32 [rows, cols], `decode` taking the blocks [n, block_bytes]
    to their values [n, block_values]."""
    if blocks.dtype != torch.uint8:
        raise QuantFormatError(f"blocks must be uint8, got {blocks.dtype}")
    rows, rb = blocks.shape
    cols = cols_from_row_bytes(rb, q)
    return decode(blocks.reshape(-1, FORMATS[q].block_bytes)).reshape(rows, cols)


def dequantize_torch(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 tensor [rows, row_bytes] -> float32 [rows, cols] on the same device (gguf-py's values, bit for bit)."""
    q = _check(qtype)
    return decode_rows(blocks, q, {"q6_k": _q6_k, "q4_k": _q4_k, "q5_k": _q5_k, "q3_k": _q3_k, "q2_k": _q2_k}[q])
