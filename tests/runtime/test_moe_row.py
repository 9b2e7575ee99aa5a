"""The one-row MoE half in one launch (runtime/gpu/moe_row.py): its three phases under the CPU interpreter against
the four shipped kernels and float32 math (tests/runtime/kernels_check.py moe_row), and its grid sizing."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.gpu import moe_row


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
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
