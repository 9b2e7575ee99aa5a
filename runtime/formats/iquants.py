"""The non-linear 4-bit formats IQ4_NL and IQ4_XS of llama.cpp's files (docs/formats.md, "Block formats"):
dequantization only.

Strata never writes them; it reads them from GGUF files llama-quantize makes (an `IQ4_XS` file, a common choice for
a 30B MoE at about 4.25 bits a weight). A 4-bit code indexes a fixed table of 16 int8 levels (`KVALUES`) instead of
a linear step. IQ4_NL: blocks of 32 values with an f16 scale; IQ4_XS: super-blocks of 256 with an f16 scale and a
6-bit scale per 32 values.

numpy: gguf-py's own `gguf.quants.dequantize` (the reference). torch: the same float32 operations in the same order,
so the values are bit for bit gguf-py's (tests compare the bits): IQ4_NL `d * kv[q]`, IQ4_XS `(d * (sc - 32)) *
kv[q]`. Each product is exact in float32 (an f16 scale, a 6-bit scale and a 7-bit level need 24 bits at most).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.formats.kquants import checked, decode_rows, reference

IQUANTS = ("iq4_nl", "iq4_xs")
# llama.cpp's kvalues_iq4nl: the 16 levels a code indexes
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _check(qtype: str) -> str:
    return checked(qtype, IQUANTS, "an IQ4 format")


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 [..., row_bytes] -> float32 [..., cols], through gguf-py's reference."""
    return reference(blocks, _check(qtype))


_LEVELS: dict[torch.device, torch.Tensor] = {}


def _levels(nib: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) -> their float32 levels. The table is made once a device: a host-to-device copy inside a
    CUDA graph capture is refused, so the capture's warm-up makes it and the capture reuses it."""
    table = _LEVELS.get(nib.device)
    if table is None:
        table = _LEVELS[nib.device] = torch.tensor(KVALUES, dtype=torch.float32, device=nib.device)
    return table[nib.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """d, qs[16]: value j < 16 the low nibble of qs[j], value 16 + j its high nibble."""
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    qs = b[:, 2:18]
    return d * _levels(torch.cat((qs & 0x0F, qs >> 4), dim=1))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d, scales_h (u16), scales_l[4], qs[128]: sub-block j (32 values) has the 6-bit scale nibble j % 2 of
    scales_l[j // 2] | bits 2j, 2j + 1 of scales_h << 4, minus 32, and reads qs[16j .. 16j + 15], low nibbles for
    its first 16 values, high for the next."""
    n = b.shape[0]
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sl = b[:, 4:8]
    lo = torch.stack((sl & 0x0F, sl >> 4), dim=2).reshape(n, 8).to(torch.int32)
    hi = (sh >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    dl = (d * ((lo | (hi << 4)) - 32).float()).reshape(n, 8, 1)
    qs = b[:, 8:136].reshape(n, 8, 1, 16)
    nib = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32)
    return (dl * _levels(nib)).reshape(n, 256)


def dequantize_torch(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 tensor [rows, row_bytes] -> float32 [rows, cols] on the same device (gguf-py's values, bit for bit)."""
    q = _check(qtype)
    return decode_rows(blocks, q, _iq4_nl if q == "iq4_nl" else _iq4_xs)
