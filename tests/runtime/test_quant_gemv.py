"""Quantized dense matrices (runtime/gpu/dense_kernels.py `quant_linear`): one row through the matrix-vector kernel,
more rows through each multi-row path (`MULTI_ROW`: the matrix dequantized into a scratch and one product, or the
matrix-vector kernel a row at a time). Checked under the Triton CPU interpreter against
the dequantized matmul, and, what the fixed-width step needs, a row's bits at one width do not depend on the other
rows of the window (nor on where the row sits in it)."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from runtime.formats.blocks import quantize
    from runtime.formats.quant_linear import QuantLinear
    from runtime.gpu import dense_kernels
    torch.manual_seed(0)
    for q, path in (("q8_0", "dequant"), ("q5_0", "dequant"), ("q4_0", "dequant"), ("q4_0", "gemv")):
        dense_kernels.MULTI_ROW = path
        w = torch.randn(48, 256) * 0.05
        blocks = torch.from_numpy(quantize(w.numpy().astype(np.float32), q))
        ref_w = QuantLinear.from_blocks(blocks, q, 256).dequantized_weight()
        for M in (1, 3, 16):
            x = torch.randn(M, 256)
            y = dense_kernels.quant_linear(x, blocks, q, 256)
            ref = x @ ref_w.T
            err = ((y - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (q, path, M, err)
            if M > 1:       # the same row among other rows, at another place of a window of the same width
                x2 = torch.randn(M, 256)
                x2[M - 1] = x[1]
                assert torch.equal(dense_kernels.quant_linear(x2, blocks, q, 256)[M - 1], y[1]), (q, path, M)
    print("ok")
""")


@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_quantized_dense_gemv_in_interpreter():
    env = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    import os

    env.update({k: v for k, v in os.environ.items() if k not in env})
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
