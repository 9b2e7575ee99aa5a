"""bench/step_ablate.py's stage removal, on the CPU: a removed stage returns its constant (no kernel, the same
buffer every call, of the stage's output shape), the others run as they are, and every function comes back after."""

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
