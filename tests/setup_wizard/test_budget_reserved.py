"""The GPU items that make the budget a prediction of reserved memory: cuBLAS workspaces, CUDA-graph pools and the
caching allocator's segments, against hand-computed figures."""

from __future__ import annotations

import pytest

from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.kv import one_row_chunks, partial_chunks, split_chunks
from runtime.models.target_config import TargetGeometry
from runtime.sampling import RULE_GRAPHS_KEPT
from setup_wizard.budget import (
    MIB,
    BudgetError,
    BudgetInputs,
    alloc_size,
    compute_budget,
    cublas_workspace_bytes,
    persistent_tensors,
    sampling_graph_bytes,
    scratch_bytes,
    segment_bytes,
)
from tests.setup_wizard.test_budget import DF, TINY

KIB = 1024


def test_cublas_workspace_is_torchs_default_per_architecture():
    assert cublas_workspace_bytes((9, 0)) == 32 * MIB             # sm90: 4096 KiB x 8
    assert cublas_workspace_bytes((8, 0)) == 8 * MIB + 128 * KIB  # elsewhere: 4096 KiB x 2 + 16 KiB x 8
    assert cublas_workspace_bytes((12, 0)) == 8 * MIB + 128 * KIB
    assert cublas_workspace_bytes(None) == 32 * MIB               # unknown GPU: the larger one
    assert cublas_workspace_bytes((9, 0), ":4096:2:16:8") == 8 * MIB + 128 * KIB
    assert cublas_workspace_bytes((8, 0), ":4096:8") == 32 * MIB
    assert cublas_workspace_bytes((9, 0), "garbage") == 32 * MIB


def test_segments_follow_the_caching_allocator():
    assert alloc_size(1) == 512 and alloc_size(512) == 512 and alloc_size(513) == 1024
    assert segment_bytes([]) == 0
    assert segment_bytes([100]) == 2 * MIB                       # small request: a 2 MiB segment
    assert segment_bytes([1 * MIB, 1 * MIB]) == 2 * MIB           # <= 1 MiB is small; two fill one segment
    assert segment_bytes([1 * MIB, 1 * MIB, 512]) == 4 * MIB
    assert segment_bytes([1 * MIB + 1]) == 20 * MIB               # 1..10 MiB: a 20 MiB segment
    assert segment_bytes([6 * MIB, 6 * MIB, 2 * MIB, 2 * MIB]) == 20 * MIB   # strata-nano's KV + embeddings at 4k
    assert segment_bytes([8 * MIB, 8 * MIB, 8 * MIB]) == 40 * MIB  # the third does not fit the first segment
    assert segment_bytes([11 * MIB]) == 12 * MIB                  # >= 10 MiB: own segment, 2 MiB granularity
    assert segment_bytes([192 * MIB, 192 * MIB, 2 * MIB, 2 * MIB]) == 404 * MIB   # nano at 128k (measured: 404)


def _cuda(context=128, block=8, **kw):
    return BudgetInputs(context=context, block=block, device_type="cuda", available_bytes=1 << 30,
                        total_bytes=1 << 30, capability=(9, 0), **kw)


# graphs: the target step, the capture warm-up, and a drafter's: MTP 2 + DFlash2 3, then at block 8 six shorter
# proposal lengths and 2 sampled settings x 7 lengths (runtime/gpu/capture.py SAMPLED_SETTINGS_KEPT)
@pytest.mark.parametrize("drafter,graphs_mib",
                         [("none", 4), ("mtp", 2 * (2 + 2 + 6 + 14)), ("dflash2", 2 * (2 + 3 + 6 + 14))])
def test_tiny_model_reserves_one_small_segment_plus_workspaces_and_graph_pools(drafter, graphs_mib):
    """Everything of the tiny model (weights, KV, transients) is < 1 MiB in all, so it lives in one 2 MiB
    segment; two 32 MiB workspaces (default + capture stream); one 2 MiB pool per captured graph (target step
    + the drafter's graphs, `drafter_graphs`) and one for the capture stream's warm-up; one 2 MiB pool per kept
    graph of the sampled acceptance (runtime.sampling.RULE_GRAPHS_KEPT)."""
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    b = compute_budget(t, drafter, _cuda(block=1 if drafter == "none" else 8), dflash2=DFlash2Geometry.from_config(DF))
    it = b.table()
    assert it["workspace"] == 64 * MIB
    assert it["graph_pool"] == graphs_mib * MIB
    assert it["sampling_graphs"] == RULE_GRAPHS_KEPT * 2 * MIB
    reserved = sum(v for k, v in it.items() if k not in ("headroom", "reserve"))
    assert reserved == 2 * MIB + 64 * MIB + graphs_mib * MIB + RULE_GRAPHS_KEPT * 2 * MIB


def test_persistent_tensor_list_sums_to_the_exact_items():
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    g = DFlash2Geometry.from_config(DF)
    for drafter in ("none", "mtp", "dflash2"):
        for quant in ("bf16", "q4_0"):
            b = compute_budget(t, drafter, _cuda(), dflash2=g, quant=quant)
            exact = sum(b.table()[k] for k in ("target_dense_weights", "drafter_weights", "target_kv",
                                                "drafter_kv", "logits", "expert_cache"))
            block = 1 if drafter == "none" else 8
            assert sum(persistent_tensors(t, drafter, 2, 2, 128, block, g, quant)) == exact


def test_no_graphs_one_workspace_no_pool_and_cpu_has_none_of_these():
    t = TargetGeometry.from_config(TINY, has_mtp=False)
    b = compute_budget(t, "none", _cuda(block=1, graphs=False))
    assert b.items["workspace"] == 32 * MIB and b.items["graph_pool"] == b.items["sampling_graphs"] == 0
    cpu = compute_budget(t, "none", BudgetInputs(context=128, block=1, device_type="cpu", available_bytes=1 << 30,
                                                 total_bytes=1 << 30, weight_bytes=4, kv_bytes=4))
    assert not {"workspace", "graph_pool", "sampling_graphs", "allocator"} & set(cpu.items)


def test_sampling_graphs_hold_the_rule_at_the_block_and_vocabulary():
    """A Qwen3-30B-A3B-sized vocabulary (151,936) at block 4, by the allocator's rule: the eight fp32 [4, V] rows
    (2.3 MiB each) share one 20 MiB segment, the sort's int64 indices (4.6 MiB) start a second, the two byte masks
    and five [V]-sized fp32 rows (594 KiB each, small) fill three 2 MiB segments: 46 MiB a graph."""
    import dataclasses

    t = dataclasses.replace(TargetGeometry.from_config(TINY, has_mtp=True), vocab=151936)
    assert sampling_graph_bytes(t, 4) == RULE_GRAPHS_KEPT * 46 * MIB
    assert sampling_graph_bytes(t, 8) > sampling_graph_bytes(t, 4)


def test_flash_scratch_grows_with_context_only_by_the_split_partials_on_cuda():
    """The CUDA prefill attention keeps no [chunk x context] scores, so the transient grows with the context only by
    the split decode attention's partials ((hd + 2) floats per head and chunk; one row: the more of runtime/kv.py
    KV_TIERS' chunks and ONE_ROW_CHUNKS' most at that context); the CPU path (math kernel) still counts the scores."""
    t = TargetGeometry.from_config(TINY, has_mtp=False)
    a = compute_budget(t, "none", _cuda(context=1024, block=1, prefill_chunk=512)).items
    b = compute_budget(t, "none", _cuda(context=4096, block=1, prefill_chunk=512)).items
    assert (split_chunks(1024), split_chunks(4096)) == (1024 // 128, 4096 // 128)   # 128-position chunks to 4096
    assert (one_row_chunks(1024), one_row_chunks(4096)) == (1024 // 32, 64)   # 32-position chunks, then 64 of them
    more = partial_chunks(1, 4096) - partial_chunks(1, 1024)
    assert more == 64 - 32
    assert b["scratch"] - a["scratch"] == 1 * t.heads * more * (t.head_dim + 2) * 4
    cpu = dict(block=1, device_type="cpu", available_bytes=1 << 30, total_bytes=1 << 30)
    c1 = compute_budget(t, "none", BudgetInputs(context=1024, **cpu)).items["scratch"]
    c2 = compute_budget(t, "none", BudgetInputs(context=4096, **cpu)).items["scratch"]
    assert c2 - c1 == 512 * t.heads * (4096 - 1024) * 4


def test_nano_at_128k_budget_terms_from_their_definitions():
    """strata-nano, no drafter, 128k context on an sm90 GPU: every item from its own definition, by hand from the
    geometry (6 layers, hidden 256, 4 heads / 2 KV heads of 64, vocab 4096, 8 experts of width 64), and the
    allocator's packing from its rule. Whether these predict what a GPU reserves is measured, not asserted here:
    `python bench/budget.py` on a GPU, `python bench/budget.py --rescore bench/results/h200_budget/budget.json`
    scores the current formula against the saved H200 peaks."""
    import json

    from bench.budget import inventory
    from bench.common import NANO
    from setup_wizard.budget import SMALL_SEGMENT, SMALL_SIZE, attention_scratch_tensors, transient_tensors

    ctx = 131072
    geo = TargetGeometry.from_config(json.loads((NANO / "config.json").read_text())).with_inventory(inventory(NANO))
    it = compute_budget(geo, "none", _cuda(context=ctx, block=1, prefill_chunk=512)).table()
    H, L, V, hd = 256, 6, 4096, 64
    per_layer = 2 * H * 4 * hd + 2 * H * 2 * hd + 2 * hd + 2 * H + H * 8      # q, o, k, v, q/k norms, 2 norms, router
    assert it["target_dense_weights"] == 2 * (2 * V * H + H + L * per_layer)     # embeddings, lm_head, final norm
    assert it["expert_cache"] == 2 * L * 8 * 3 * H * 64                          # every expert resident
    assert it["target_kv"] == L * 2 * 2 * hd * 2 * ctx == 384 * MIB              # K and V, BF16
    assert it["logits"] == 1 * V * 4 and it["drafter_weights"] == it["drafter_kv"] == 0
    assert it["workspace"] == 2 * 32 * MIB                   # sm90 cuBLAS workspace, default + capture stream
    assert it["graph_pool"] == 2 * 2 * MIB                   # the target step's graph + the capture warm-up
    # the allocator term: what packing every persistent and prefill-transient tensor into segments adds
    pers = persistent_tensors(geo, "none", 2, 2, ctx, 1)
    attn = attention_scratch_tensors(geo, "none", context=ctx, block=1, wb=2, cuda=True)
    chunks = 4096 // 128 + (32768 - 4096) // 256 + (ctx - 32768) // 1024
    assert attn == [1 * 4 * chunks * (hd + 2) * 4]   # the split attention's fp32 partials, 1 row
    trans = transient_tensors(geo, 512, 2) + attn
    assert sum(pers) == sum(it[k] for k in ("target_dense_weights", "target_kv", "logits", "expert_cache"))
    assert sorted(pers, reverse=True)[:4] == [192 * MIB, 192 * MIB, 2 * MIB, 2 * MIB]   # K, V, embed, lm_head
    assert all(n <= SMALL_SIZE for n in sorted(pers, reverse=True)[4:] + trans)
    small = sum(alloc_size(n) for n in sorted(pers, reverse=True)[4:] + trans)
    large = 2 * 192 * MIB + 20 * MIB                          # K and V own segments; both 2 MiB tensors share one
    packed = large + -(-small // SMALL_SEGMENT) * SMALL_SEGMENT
    assert segment_bytes(pers + trans) == packed
    assert it["allocator"] == packed - sum(pers) - it["scratch"]
    reserved = sum(v for k, v in it.items() if k not in ("headroom", "reserve"))
    assert it["sampling_graphs"] == RULE_GRAPHS_KEPT * 2 * MIB       # each rule's rows of 4096 fit 2 MiB
    assert reserved == packed + it["workspace"] + it["graph_pool"] + it["sampling_graphs"]


def _partials(rows, heads, ctx, hd):
    return rows * heads * partial_chunks(rows, ctx) * (hd + 2) * 4


@pytest.mark.parametrize("graphs", [True, False])
def test_scratch_counts_the_split_attention_partials_of_target_and_drafter(graphs):
    """CUDA: the target step's partials (block rows x heads x chunks x (hd + 2) fp32) and, with graphs, the drafter
    graphs' own (MTP: the target's heads; DFlash2: the head's)."""
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    g = DFlash2Geometry.from_config(DF)
    ctx, block = 1000, 8
    base = scratch_bytes(t, context=ctx, block=block, prefill_chunk=64, act_bytes=2, flash=True)
    tgt = _partials(block, t.heads, ctx, t.head_dim)
    want = {"none": _partials(1, t.heads, ctx, t.head_dim) - tgt, "mtp": tgt if graphs else 0,
            "dflash2": _partials(block, g.num_heads, ctx, g.head_dim) if graphs else 0}
    for drafter, extra in want.items():
        b = compute_budget(t, drafter, _cuda(context=ctx, block=block, prefill_chunk=64, graphs=graphs), dflash2=g)
        rows = block if drafter != "none" else 1
        assert b.items["scratch"] - scratch_bytes(t, context=ctx, block=rows, prefill_chunk=64, act_bytes=2,
                                                  flash=True) == tgt + extra, drafter
    assert base > 0


def test_q8_0_cache_items():
    """kv_quant = "q8_0": the target's cache at hd + 2*hd/32 bytes per head vector (drafters' caches unchanged),
    the prefill's dequantization buffers in scratch (2 x nkv x ctx x hd x wb; on CPU also two fp32 temporaries),
    and the persistent tensors still sum to the exact items."""
    t = TargetGeometry.from_config({**TINY, "head_dim": 64}, has_mtp=True)
    g = DFlash2Geometry.from_config(DF)
    ctx = 4096
    for drafter in ("none", "mtp", "dflash2"):
        plain = compute_budget(t, drafter, _cuda(context=ctx), dflash2=g)
        q8 = compute_budget(t, drafter, _cuda(context=ctx, kv_quant="q8_0"), dflash2=g)
        assert q8.items["target_kv"] == t.layers * 2 * t.kv_heads * ctx * (64 + 4)
        assert plain.items["target_kv"] == t.layers * 2 * t.kv_heads * ctx * 64 * 2
        assert q8.items["drafter_kv"] == plain.items["drafter_kv"]
        assert q8.items["scratch"] - plain.items["scratch"] == 2 * t.kv_heads * ctx * 64 * 2
        exact = sum(q8.table()[k] for k in ("target_dense_weights", "drafter_weights", "target_kv", "drafter_kv",
                                              "logits", "expert_cache"))
        block = 1 if drafter == "none" else 8
        assert sum(persistent_tensors(t, drafter, 2, 2, ctx, block, g, "bf16", "q8_0")) == exact
    cpu = dict(context=ctx, block=1, device_type="cpu", available_bytes=1 << 34, total_bytes=1 << 34, weight_bytes=4,
               kv_bytes=4)
    a = compute_budget(t, "none", BudgetInputs(**cpu)).items
    b = compute_budget(t, "none", BudgetInputs(kv_quant="q8_0", **cpu)).items
    assert b["scratch"] - a["scratch"] == 2 * t.kv_heads * ctx * 64 * (4 + 4)
    assert b["target_kv"] == t.layers * 2 * t.kv_heads * ctx * 68


def test_prefill_chunk_defaults_per_device_and_is_an_input():
    """The budget's prefill chunk is the runtime's default for the device unless given (runtime/memory.py)."""
    from runtime.memory import default_prefill_chunk

    t = TargetGeometry.from_config(TINY, has_mtp=False)
    for dev, kw in (("cuda", {}), ("cpu", dict(weight_bytes=4, kv_bytes=4))):
        inp = dict(context=1 << 14, block=1, device_type=dev, available_bytes=1 << 34, total_bytes=1 << 34, **kw)
        dflt = compute_budget(t, "none", BudgetInputs(**inp)).items["scratch"]
        same = compute_budget(t, "none", BudgetInputs(prefill_chunk=default_prefill_chunk(dev), **inp))
        assert same.items["scratch"] == dflt
        big = compute_budget(t, "none", BudgetInputs(prefill_chunk=4 * default_prefill_chunk(dev), **inp))
        assert big.items["scratch"] > dflt
    assert default_prefill_chunk("cuda") == 2048 and default_prefill_chunk("cpu") == 512
    with pytest.raises(BudgetError, match="KV cache format"):
        compute_budget(t, "none", _cuda(kv_quant="q4_0"))
