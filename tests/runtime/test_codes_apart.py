"""Block rows with their codes apart from their scales (runtime/gpu/moe_gemv.py `codes_apart`; docs/models.md,
"Expert rows on a GPU"): the same bytes moved within each row, so the layout round-trips, and every kernel that reads
it (the decode windows' matrix-vector tiles, the prefill tiles, a dense block product) gives the bits it gives on
ggml's own rows. The kernels run under the Triton CPU interpreter in a subprocess."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from runtime.formats.blocks import quantize
from runtime.gpu import moe_gemv

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from runtime.formats.blocks import quantize
    from runtime.gpu import dense_kernels, moe_gemv, moe_kernels
    torch.manual_seed(0)
    E, H, I, k = 4, 256, 64, 2
    for q in ("q4_0", "q8_0"):
        def blocks(n, c):
            return torch.from_numpy(quantize((torch.randn(n, c) * 0.05).numpy(), q))
        gu = torch.stack([blocks(2 * I, H) for _ in range(E)])
        dn = torch.stack([blocks(H, I) for _ in range(E)])
        gua, dna = moe_gemv.codes_apart(gu, q), moe_gemv.codes_apart(dn, q)
        for T in (1, 3, moe_kernels.DECODE_ROWS + 1):      # one row, a verify window, a prefill chunk
            x = torch.randn(T, H)
            idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
            w = torch.rand(T, k)
            a = moe_kernels.moe_grouped(x, idx, w, gu, dn, fmt=q)
            b = moe_kernels.moe_grouped(x, idx, w, gua, dna, fmt=q, apart=True)
            assert torch.equal(a, b), (q, T, (a - b).abs().max())
        wd = blocks(48, 768)
        for name in ("u4d8k2np", "qone4j2"):
            for j in (1, 2):
                c = {**moe_gemv.GEMV_VARIANTS[name], "J": j}
                x = torch.randn(1, 768)
                y = dense_kernels.gemv(x, wd, q, c)
                assert torch.equal(y, dense_kernels.gemv(x, moe_gemv.codes_apart(wd, q), q, {**c, "APART": 1})), \\
                    (q, name, j)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_kernels_give_the_same_bits_on_rows_with_codes_apart():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_codes_apart_moves_each_rows_codes_ahead_of_its_scales(fmt):
    torch.manual_seed(1)
    w = torch.from_numpy(quantize((torch.randn(6, 96) * 0.05).numpy(), fmt))       # 3 blocks a row
    a = moe_gemv.codes_apart(w, fmt)
    assert a.shape == w.shape and a.dtype == torch.uint8
    assert torch.equal(moe_gemv.codes_inline(a, fmt), w)
    bb, cb = (18, 16) if fmt == "q4_0" else (34, 32)
    for r in range(w.shape[0]):
        for b in range(3):      # block b's codes at cb * b, its float16 scale after every block's codes
            assert torch.equal(a[r, cb * b:cb * (b + 1)], w[r, bb * b + 2:bb * (b + 1)])
            assert torch.equal(a[r, 3 * cb + 2 * b:3 * cb + 2 * b + 2], w[r, bb * b:bb * b + 2])
    # stacks of experts: each row on its own
    st = torch.stack([w, w.flip(0)])
    assert torch.equal(moe_gemv.codes_apart(st, fmt)[1], moe_gemv.codes_apart(w.flip(0), fmt))


def test_sparse_moe_keeps_ggml_rows_off_the_gpu():
    """`SparseMoe.codes_apart` changes only stacks resident on a GPU: a CPU stack (what the CPU paths and the expert
    pool's host copies read) and a format without that layout stay as they are."""
    from runtime.models.layers import SparseMoe
    from runtime.models.target_config import Qwen3MoeConfig
    from tests.runtime.tiny import tiny_config

    cfg = Qwen3MoeConfig.from_dict(tiny_config(hidden=64, moe_inter=32))
    for fmt in ("q4_0", "q5_0"):
        blk = SparseMoe(cfg)
        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        gu = torch.from_numpy(np.concatenate([quantize(np.random.randn(2 * i, h).astype(np.float32), fmt)
                                              for _ in range(e)])).reshape(e, 2 * i, -1)
        dn = torch.from_numpy(np.concatenate([quantize(np.random.randn(h, i).astype(np.float32), fmt)
                                              for _ in range(e)])).reshape(e, h, -1)
        blk.bind_blocks(gu.clone(), dn.clone(), fmt)
        assert blk.codes_apart() is False and not blk.apart
        assert torch.equal(blk.gate_up, gu) and torch.equal(blk.down, dn)
