"""The benchmarks' A3B-shaped random target (bench/common.py): honest routing's weight scales and the
distinct-experts figure, on a tiny config on the CPU."""

import pytest
import torch

from bench.common import HONEST, build_random_a3b, distinct_experts
from tests.runtime.tiny import single_thread, tiny_config  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _cfg():
    return tiny_config(vocab=512, hidden=64, layers=2, experts=16, top_k=2, moe_inter=32, mtp=False)


def test_honest_builder_scales_embeddings_and_residual_writers():
    m, _ = build_random_a3b(_cfg(), device="cpu", honest=True)
    plain, _ = build_random_a3b(_cfg(), device="cpu", honest=False)
    std = lambda t: float(t.float().std())  # noqa: E731
    res = 0.02 * HONEST["residual_scale"]
    assert abs(std(m.model.embed_tokens.weight) - HONEST["embed_std"]) < 0.05
    assert abs(std(plain.model.embed_tokens.weight) - 0.02) < 0.002
    layer = m.model.layers[0]
    assert abs(std(layer.self_attn.o_proj.weight) / res - 1) < 0.1
    assert abs(std(layer.mlp.down) / res - 1) < 0.1
    assert abs(std(layer.mlp.gate_up) - 0.02) < 0.002
    assert layer.mlp.experts[3].down_proj.weight.data_ptr() == layer.mlp.down[3].data_ptr()   # stacked views


def test_distinct_experts_counts_each_window():
    m, _ = build_random_a3b(_cfg(), device="cpu", honest=True)
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    one = distinct_experts(m, ids, 1)
    assert one["per_layer"] == [2.0, 2.0] and one["windows"] == 48
    w8 = distinct_experts(m, ids, 8)
    assert w8["windows"] == 6 and all(2 <= d <= 16 for d in w8["per_layer"])
    assert abs(w8["uniform"] - 16 * (1 - (1 - 2 / 16) ** 8)) < 1e-9
