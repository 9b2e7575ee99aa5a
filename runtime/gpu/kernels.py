"""The Triton fast path's switch: whether Triton is importable, whether the kernels may run on a tensor, and small
helpers the kernel modules share. The kernels themselves live by topic beside this file: `moe_kernels` (routed
experts), `attention_kernels` (KV cache, attention), `dense_kernels` (RMSNorm, quantized linear), `dflash2_kernels`
(the drafter's convolution and selector walk).

Every kernel is *row-invariant* (a row's result depends only on that row's inputs, never on how many other rows share
the launch or where the row sits in it: fixed tiles, no split-K, fixed loop order; the decode attention splits a
row's context, but into chunks fixed by absolute position and combined in a fixed order), so a one-row decode and a
k-row verify of the same token give the same bits in BF16 (docs/models.md, "Numerics"). Tests run them on CPU under
TRITON_INTERPRET=1 (float32/float16 there: the interpreter has no bfloat16).
"""

from __future__ import annotations

import os

from torch import Tensor

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the callers use their torch paths
    HAVE_TRITON = False


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton ((0, 0) without one): some tile tables depend on how a Triton lays
    tiles out (runtime/gpu/moe_gemv.py, `R1_FROM`)."""
    if not HAVE_TRITON:
        return (0, 0)
    import re

    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

# every launch names Triton's contraction of a * b + c into one FMA instead of taking its default: on (the default
# through Triton 3.9, which warns that 3.10 turns it off), the arithmetic every kernel was checked and timed with,
# whichever Triton builds it (docs/models.md, "Numerics")
FMA = {"enable_fp_fusion": True}

ENABLED = True   # benchmarks switch the kernels off to measure the plain-torch path ("before")


def available(t: Tensor) -> bool:
    """True when the Triton path can run on tensor `t` (CUDA with Triton, or the CPU interpreter in tests)."""
    return ENABLED and HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def pow2(n: int, lo: int = 16) -> int:
    """The next power of two >= n, at least `lo` (tile sizes)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))
