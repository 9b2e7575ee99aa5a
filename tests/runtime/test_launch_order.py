"""Which launches the split attention and its reduction take (runtime/gpu/pdl.py `TRIGGER_FIRST`, docs/models.md
"Letting a kernel two launches ahead in"): the selection logic on the CPU, with the probe and the device stubbed."""

from types import SimpleNamespace

import pytest
import torch

from runtime.gpu import dense_kernels, moe_gemv, pdl
from runtime.gpu.kernels import FMA


@pytest.fixture
def cuda_like(monkeypatch):
    """A stand-in for a CUDA tensor on a GPU whose Triton launches with PDL."""
    monkeypatch.setattr(pdl, "_probe", lambda device: True)
    monkeypatch.setattr(pdl, "HAVE_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


def test_the_reduction_before_an_early_o_proj_lets_it_in_first(cuda_like):
    assert pdl.launch(cuda_like, "attention_reduce:o_early") == {"GDC": 2, "launch_pdl": True, **FMA}
    assert pdl.launch(cuda_like, "attention:o_early") == {"GDC": True, "launch_pdl": True, **FMA}      # split on PDL
    assert pdl.launch(cuda_like, "attention_reduce") == {"GDC": True, "launch_pdl": True, **FMA}      # waits first
    assert pdl.launch(cuda_like, "attention") == {"GDC": False, **FMA}                                # split apart
    assert pdl.launch(cuda_like, "") == {"GDC": True, "launch_pdl": True, **FMA}


def test_pdl_off_or_no_probe_means_plain_launches(cuda_like, monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch(cuda_like, "attention_reduce:o_early") == {"GDC": False, **FMA}
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_probe", lambda device: False)
    assert pdl.launch(cuda_like, "attention_reduce:o_early") == {"GDC": False, **FMA}


def test_loads_early_follows_the_o_proj_tiles(monkeypatch):
    """o_early exactly when o_proj takes a one-step variant with EARLY: float weights, a window no wider than
    DENSE_GEMV_ROWS["o_proj"], early loads on."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")          # `one_row` takes CPU tensors only in the interpreter
    if not dense_kernels.HAVE_TRITON:
        pytest.skip("needs Triton")
    w = torch.zeros(32, 64)
    widest = dense_kernels.dense_rows("o_proj")
    assert dense_kernels.loads_early(torch.zeros(1, 64), w, "o_proj")
    assert dense_kernels.loads_early(torch.zeros(widest, 64), w, "o_proj")
    assert not dense_kernels.loads_early(torch.zeros(widest + 1, 64), w, "o_proj")
    assert not dense_kernels.loads_early(torch.zeros(1, 64), None, "o_proj")     # a block-format o_proj
    assert not dense_kernels.loads_early(torch.zeros(1, 64, dtype=torch.float16), w, "o_proj")
    monkeypatch.setattr(moe_gemv, "EARLY_LOADS", False)
    assert not dense_kernels.loads_early(torch.zeros(1, 64), w, "o_proj")
