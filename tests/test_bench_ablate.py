"""bench/step_ablate.py's stage removal, on the CPU: a removed stage returns its constant (no kernel, the same
buffer every call, of the stage's output shape), the others run as they are, and every function comes back after."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.step_ablate import STAGES, Consts, ablate
from runtime.gpu import attention_kernels, dense_kernels, moe_kernels, static_step


def test_removed_stages_return_constants_and_everything_is_restored():
    before = (attention_kernels.qkv_post, attention_kernels.attention, dense_kernels.norm_one_row,
              dense_kernels.quant_norm_one_row, static_step._proj, moe_kernels.route, moe_kernels.moe_routed)
    consts = Consts()
    q = torch.randn(1, 4, 8)
    x, w = torch.randn(1, 16), torch.randn(6, 16)
    with ablate("post+attention+router", consts):
        assert attention_kernels.qkv_post is not before[0]
        o1 = attention_kernels.attention(q, None, None, None, 1.0)
        assert o1.shape == q.shape and attention_kernels.attention(q, None, None, None, 1.0) is o1
        xo, h, lg = dense_kernels.norm_one_row(x, None, torch.ones(16), 1e-6, w, "router")
        assert xo is x and lg.shape == (1, 6)
        # a stage not removed runs: the q/k/v role goes to the real function (no one-row variant on the CPU)
        assert dense_kernels.norm_one_row(x, None, torch.ones(16), 1e-6, w, "qkv") is None
    assert (attention_kernels.qkv_post, attention_kernels.attention, dense_kernels.norm_one_row,
            dense_kernels.quant_norm_one_row, static_step._proj, moe_kernels.route, moe_kernels.moe_routed) == before


def test_experts_removed_leave_the_residual():
    x, res = torch.randn(1, 16), torch.randn(1, 16)
    with ablate("experts", Consts()):
        assert moe_kernels.moe_routed(x, res, None, None, None) is res
    assert "route-relay" in STAGES and "post+attention" in STAGES


RELAY = """
import torch
from bench.step_ablate import Consts, ablate
from runtime.gpu import moe_kernels
lg = torch.randn(3, 8)
pos = torch.tensor([4, 5, -1], dtype=torch.int32)
ref = moe_kernels.route(lg, pos, 2, True)
with ablate("route-relay", Consts()):
    got = moe_kernels.route(lg, pos, 2, True)
for name, a, b in zip(ref._fields, ref, got, strict=True):
    assert torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape, name
print("relay ok")
"""


def test_route_relay_hands_on_the_routing_kernels_tables_unchanged():
    """route-relay copies the routing kernel's tables (weights through their bits) for the experts to read: run in
    the Triton interpreter, the copies equal the kernel's own tables."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", RELAY], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0 and "relay ok" in r.stdout, r.stderr[-2000:]
