"""The one-row MoE half in one launch (runtime/gpu/moe_row.py): its three phases under the CPU interpreter against
the four shipped kernels and float32 math (tests/runtime/kernels_check.py moe_row), and its grid sizing."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.gpu import moe_row


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(not moe_row.ENABLED and not os.environ.get("STRATA_CHECK_OFF_PATHS"),
                    reason="moe_row is off (timed slower than the four launches on an H200, docs/models.md): its "
                           "30 s interpreter check runs when it is on, or with STRATA_CHECK_OFF_PATHS=1")
@pytest.mark.timeout(300)
def test_moe_row_in_interpreter():
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script), "moe_row"], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0 and "moe row ok" in r.stdout, r.stderr[-3000:]


def test_grid_holds_only_programs_that_fit_at_once(monkeypatch):
    # 132 SMs of 64K registers: 8 warps at 172 registers a thread (176 allocated) fit one program an SM, at 96 two
    monkeypatch.setattr(moe_row, "_sm", lambda index: (132, 65536, 228 * 1024))
    dev = torch.device("cuda", 0)
    k = SimpleNamespace(n_regs=172, metadata=SimpleNamespace(shared=65664))
    assert moe_row._programs(dev, k, 2, 8) == 132
    k.n_regs = 96
    assert moe_row._programs(dev, k, 2, 8) == 264 and moe_row._programs(dev, k, 4, 8) == 264
    k.metadata.shared = 120 * 1024          # shared memory for one program an SM
    assert moe_row._programs(dev, k, 2, 8) == 132
    k.n_regs, k.metadata.shared = 32, 0
    assert moe_row._programs(dev, k, 16, 4) == 132 * 16


def test_applies_only_where_the_kernel_reads_the_experts(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moe_row.kernels, "HAVE_TRITON", True)
    x = torch.zeros(1, 64)
    wr = torch.zeros(8, 64)

    def mlp(**kw):
        base = dict(gate_up=torch.zeros(8, 32, 64), down=torch.zeros(8, 64, 16), fmt=None, slot=None, offload=None,
                    miss_fn=None)
        return SimpleNamespace(**{**base, **kw})
    monkeypatch.setattr(moe_row, "ENABLED", False)
    assert not moe_row.applies(x, wr, mlp())                                # off unless switched on
    monkeypatch.setattr(moe_row, "ENABLED", True)
    assert moe_row.applies(x, wr, mlp())
    assert not moe_row.applies(torch.zeros(2, 64), wr, mlp())               # one row only
    assert not moe_row.applies(x, None, mlp())                              # a block-format router
    assert not moe_row.applies(x, wr, mlp(slot=torch.zeros(8, dtype=torch.int32)))      # a slot table
    assert not moe_row.applies(x, wr, mlp(offload=object()))
    assert not moe_row.applies(x, wr, mlp(gate_up=torch.zeros(8, 32, 64, dtype=torch.float16)))
    blocks = mlp(gate_up=torch.zeros(8, 32, 36, dtype=torch.uint8), down=torch.zeros(8, 64, 18, dtype=torch.uint8))
    for fmt, ok in (("q4_0", True), ("q8_0", True), ("iq4_nl", True), ("q4_k", False), (("q4_0", "q8_0"), False)):
        blocks.fmt = fmt
        assert moe_row.applies(x, wr, blocks) == ok, fmt
