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
    # a drafter's stacked q/k/v in one GEMV launch (runtime/gpu/capture.py QuantStack, on DRAFT_GEMV's tile and on
    # the decode windows') equals the three products, and a row's bits do not depend on the other rows
    from runtime.gpu import capture
    from runtime.gpu.capture import stack_quant_linears
    shipped = dict(capture.DRAFT_GEMV)
    assert shipped, "the shipped table names a tile"
    for q in ("q4_0", "q8_0"):
        mods = [QuantLinear.from_float(torch.randn(n, 256) * 0.05, q) for n in (32, 16, 16)]
        x = torch.randn(5, 256)
        ref = torch.cat([x @ m.dequantized_weight().T for m in mods], -1)
        st = stack_quant_linears(mods)
        for table in (shipped, {}):
            capture.DRAFT_GEMV.clear()
            capture.DRAFT_GEMV.update(table)
            y = st(x)
            assert ((y - ref).norm() / ref.norm()).item() < 1e-5, (q, table)
            assert torch.equal(st(x[2:3])[0], y[2]), (q, table)
    print("ok")
""")


@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_quantized_dense_gemv_in_interpreter():
    env = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    import os

    env.update({k: v for k, v in os.environ.items() if k not in env})
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_stacked_block_modules_share_one_matrix():
    """`stack_quant_linears` (a drafter's q/k/v as one block matrix): the modules' blocks become views of it, bytes
    unchanged, and the stack's product on the CPU equals the modules' own; other modules are left alone."""
    import torch

    from runtime.formats.quant_linear import QuantLinear
    from runtime.gpu.capture import stack_quant_linears

    torch.manual_seed(1)
    mods = [QuantLinear.from_float(torch.randn(n, 64) * 0.05, "q8_0") for n in (32, 16, 16)]
    before = [m.blocks.clone() for m in mods]
    x = torch.randn(3, 64)
    outs = [m(x) for m in mods]
    st = stack_quant_linears(mods)
    assert st is not None and st.blocks.shape[0] == 64
    for m, b in zip(mods, before, strict=True):
        assert torch.equal(m.blocks, b) and m.blocks.data_ptr() >= st.blocks.data_ptr()
        assert m.blocks._base is st.blocks
    assert torch.equal(st(x), torch.cat(outs, -1))
    again = stack_quant_linears(mods)                     # a second graph set: the same matrix, no new copy
    assert again.blocks.data_ptr() == st.blocks.data_ptr()
    other = QuantLinear.from_float(torch.randn(8, 32) * 0.05, "q8_0")      # another input width: not stacked
    assert stack_quant_linears([mods[0], other]) is None
    assert stack_quant_linears([torch.nn.Linear(64, 8, bias=False)]) is None


def test_stacked_float_modules_share_one_matrix():
    """`stack_linears` (a drafter's float q/k/v as one matrix): the modules' weights become views of it, values
    unchanged; stacking them again (a second graph set) returns the same bytes instead of a second copy, and
    modules that are not consecutive rows of one buffer get a fresh matrix."""
    import torch

    from runtime.gpu.capture import stack_linears

    torch.manual_seed(2)
    mods = [torch.nn.Linear(64, n, bias=False) for n in (32, 16, 16)]
    before = [m.weight.detach().clone() for m in mods]
    x = torch.randn(3, 64)
    outs = [m(x) for m in mods]
    st = stack_linears(mods)
    assert st is not None and st.shape == (64, 64)
    for m, b in zip(mods, before, strict=True):
        assert torch.equal(m.weight, b) and m.weight.untyped_storage().data_ptr() == st.untyped_storage().data_ptr()
    assert torch.allclose(x @ st.t(), torch.cat(outs, -1), rtol=1e-6, atol=1e-6)
    again = stack_linears(mods)
    assert again.data_ptr() == st.data_ptr() and again.shape == st.shape and torch.equal(again, st)
    swapped = stack_linears([mods[1], mods[0], mods[2]])     # not in storage order: a copy, values in that order
    assert swapped.data_ptr() != st.data_ptr()
    assert torch.equal(swapped, torch.cat([before[1], before[0], before[2]]))

