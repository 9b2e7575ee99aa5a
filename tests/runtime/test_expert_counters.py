"""Expert-cache hit/miss counters count (token, expert) pairs, on every path: the per-expert loop (CPU-served or
resident) and the stacked kernel path, which reports its real rows from the host (no device sync)."""

import torch

from runtime.experts import ExpertCache
from runtime.gpu import kernels, moe_kernels
from runtime.loading import load_target
from tests.runtime.tiny import make_tiny_target


def test_loop_path_counts_rows_times_top_k(tmp_path):
    folder = make_tiny_target(tmp_path, mtp=False)
    model = load_target(folder)
    cache = ExpertCache(model, torch.device("cpu"), slots=6, enforce_on_cpu=True)
    top_k, layers = model.cfg.num_experts_per_tok, len(cache.blocks)
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        model(ids)
    st = cache.stats()
    assert st["hits"] + st["misses"] == 20 * top_k * layers
    assert 0 < st["hits"] < 20 * top_k * layers


def test_stacked_kernel_path_counts_from_the_host(tmp_path, monkeypatch):
    folder = make_tiny_target(tmp_path, mtp=False)
    model = load_target(folder)
    cache = ExpertCache(model, torch.device("cpu"))
    for blk in cache.blocks.values():
        blk.stack_experts()
    calls = []

    def fake_grouped(x, idx, w, gate_up, down, **kw):     # stands in for the Triton kernel on the CPU
        calls.append(x.shape[0])
        return torch.zeros_like(x)

    monkeypatch.setattr(kernels, "available", lambda t: True)
    monkeypatch.setattr(moe_kernels, "moe_grouped", fake_grouped)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 7)))
    assert calls == [7] * len(cache.blocks)
    assert cache.stats()["hits"] == 7 * model.cfg.num_experts_per_tok * len(cache.blocks)
    assert cache.stats()["misses"] == 0
    cache.count_rows(-5, 3)                          # a layer that is not a cached MoE block: ignored
    assert cache.stats()["hits"] == 7 * model.cfg.num_experts_per_tok * len(cache.blocks)
