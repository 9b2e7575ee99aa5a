"""The expert offload (runtime/experts.py, expert_arena.py, expert_pool.py, routing_profile.py) on the CPU: a partial
cache is emulated (`enforce_on_cpu`) and must give the all-resident run's greedy token ids on every path (streamed
misses, CPU-computed misses, the legacy cache, the fixed-width step, speculative windows), count what it did, keep
its LRU honest, and place its slots by the routing profile. The kernel paths run in the Triton interpreter."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.drafters.mtp import MTPDrafter
from runtime.errors import ConfigError, UsageError
from runtime.expert_arena import ExpertArena
from runtime.expert_pool import SlotPool
from runtime.experts import ExpertCache
from runtime.gpu.static_step import StaticStep
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.routing_profile import RoutingProfile, uniform_profile
from runtime.speculative import generate_ids
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = [5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("offload"), experts=8, top_k=2, layers=3, seed=1, scale=2.0,
                            mtp=False)


def _build(folder, slots, miss="stream", lru=0, profile=None):
    m = load_target(folder)
    c = ExpertCache(m, torch.device("cpu"), slots, enforce_on_cpu=slots is not None, miss=miss, lru_slots=lru,
                    profile=profile)
    c.place(m)
    return m, c


def _kv(m, cap=128):
    cfg = m.cfg
    return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cap)


@pytest.fixture(scope="module")
def reference(folder):
    m, _ = _build(folder, None)
    ids = generate_ids(m, _kv(m), PROMPT, max_new_tokens=24).token_ids
    assert len(set(ids)) > 8                       # a model that says something, so a wrong expert would show
    return ids


@pytest.mark.parametrize("slots,miss,lru", [(12, "stream", 0), (5, "stream", 0), (2, "stream", 0), (6, "stream", 4),
                                            (12, "cpu", 0), (3, "cpu", 0), (16, "legacy", 0)])
def test_partial_cache_gives_the_all_resident_ids(folder, reference, slots, miss, lru):
    m, c = _build(folder, slots, miss, lru)
    out = generate_ids(m, _kv(m), PROMPT, max_new_tokens=24)
    assert out.token_ids == reference
    st = c.stats()
    pairs = (len(PROMPT) + 23) * 2 * 3            # prefill + decoded rows, top-2, 3 MoE layers
    assert st["hits"] + st["misses"] == pairs
    assert st["misses"] > 0 and (st["hits"] > 0 or slots <= 2)
    if miss == "stream":
        assert 0 < st["fetched"] <= st["misses"]
        assert st["fetched_bytes"] == st["fetched"] * c.expert_nbytes
    else:
        assert st["fetched"] == 0


def test_experts_leave_the_model_for_the_arena(folder):
    m, c = _build(folder, 6)
    assert c.mode == "pool" and c.arena is not None
    blk = c.blocks[0]
    gu = c.arena.plane(0, "gate_up")
    assert blk.experts[3].gate_proj.weight.data_ptr() == gu[3].data_ptr()       # a view, no second copy
    assert c.resident_nbytes == 6 * c.expert_nbytes                           # the pool is the budget's slots


def test_fixed_width_step_and_speculative_windows_keep_the_ids(folder):
    m, _ = _build(folder, None)
    kv = _kv(m)
    ref = generate_ids(m, kv, PROMPT, max_new_tokens=20, step=StaticStep(m, kv, 4, graph=False)).token_ids
    m2, c = _build(folder, 10)
    kv2 = _kv(m2)
    step = StaticStep(m2, kv2, 4, graph=False)
    assert c.pool.D == 8                       # a 4-row window may need min(4 * 2, 8) experts of one layer at once
    assert generate_ids(m2, kv2, PROMPT, max_new_tokens=20, step=step).token_ids == ref


def test_mtp_speculative_through_a_partial_cache(tmp_path):
    folder = make_tiny_target(tmp_path, experts=8, top_k=2, layers=3, seed=2, scale=2.0, mtp=True)
    m, _ = _build(folder, None)
    ref = generate_ids(m, _kv(m), PROMPT, max_new_tokens=20).token_ids
    m2, c = _build(folder, 9)
    got = generate_ids(m2, _kv(m2), PROMPT, drafter=MTPDrafter(m2, 128, max_block=4), block=4,
                       max_new_tokens=20)
    assert got.token_ids == ref
    assert c.stats()["misses"] > 0


# ------------------------------------------------------------------------------------------------- the slot pool
def _arena(E=6, layers=(0, 1)):
    t = {li: {"gate_up": torch.arange(E * 4, dtype=torch.float32).view(E, 2, 2) + 100 * li,
              "down": -torch.arange(E * 2, dtype=torch.float32).view(E, 2, 1) - 100 * li} for li in layers}
    return ExpertArena(t)


def test_pool_lru_evicts_the_oldest_and_never_what_the_window_uses():
    arena = _arena()
    pool = SlotPool(arena, {0: [0], 1: [5]}, [], 3, torch.device("cpu"))
    assert pool.P == 5 and pool.D == 3
    f = torch.tensor

    def slots(layer, ids):
        return pool.plan(layer, f(ids)).tolist()

    s = slots(0, [0, 2, 6])                       # 6 = padding (E): no expert
    assert s[0] == 0 and s[2] == pool.P and s[1] >= 2
    assert torch.equal(pool.planes["gate_up"][s[1]], arena.plane(0, "gate_up")[2])
    slots(0, [3, 4])                              # fills the other two dynamic slots
    assert pool.stats()["fetched"] == 3
    # layer 1 needs two experts: the two used longest ago are layer 0's 2 (oldest), then 3
    s1 = slots(1, [1, 2])
    assert pool.lookup(0, f([2, 3, 4])).tolist()[0] == -1 and pool.lookup(0, f([3])).tolist() == [-1]
    assert pool.lookup(0, f([4])).tolist()[0] >= 0
    assert torch.equal(pool.planes["down"][s1[0]], arena.plane(1, "down")[1])
    # a hit refreshes: layer 0's 4 is used again, then one miss must evict layer 1's 1 (older than 2)
    slots(1, [2, 5])
    slots(0, [4, 1])
    assert pool.lookup(1, f([1])).tolist() == [-1] and pool.lookup(1, f([2])).tolist()[0] >= 0
    st = pool.stats()
    assert st["pair_hits"] + st["pair_misses"] == 2 + 2 + 2 + 2 + 2     # padding is not a pair
    with pytest.raises(RuntimeError, match="staging slots"):
        pool.plan(0, f([0, 1, 2, 3]))             # may need 4 dynamic slots; the pool has 3


def test_bad_arguments_are_one_sentence(folder):
    m = load_target(folder)
    with pytest.raises(UsageError, match="miss policy"):
        ExpertCache(m, torch.device("cpu"), 3, enforce_on_cpu=True, miss="fast")
    with pytest.raises(UsageError, match=">= 0"):
        ExpertCache(m, torch.device("cpu"), -1)
    other = uniform_profile([0, 1], 8)
    with pytest.raises(UsageError, match="routing profile"):
        ExpertCache(m, torch.device("cpu"), 3, enforce_on_cpu=True, profile=other)


# -------------------------------------------------------------------------------------------- routing profile
def test_profile_places_the_hottest_and_predicts_the_hit_rate(tmp_path):
    p = RoutingProfile([0, 2], [[10, 0, 30, 0], [5, 5, 5, 25]])
    assert p.placement(3) == {0: [0, 2], 2: [3]}
    assert p.expected_hit_rate(3) == pytest.approx((0.75 + 0.25 + 25 / 40) / 2)
    assert p.expected_hit_rate(8) == pytest.approx(1.0)
    u = uniform_profile([0, 1, 2], 4)                # no evidence: spread evenly, lowest ids (the old placement)
    assert u.placement(5) == {0: [0, 1], 1: [0, 1], 2: [0]}
    path = p.save(tmp_path / "routing.json")
    q = RoutingProfile.load(path)
    assert q.counts == p.counts and q.layers == p.layers
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        RoutingProfile.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"version": 0}))
    with pytest.raises(ConfigError, match="record it again"):
        RoutingProfile.load(tmp_path / "old.json")


def test_recorded_profile_counts_every_choice_and_places_the_cache(folder, reference):
    m, c = _build(folder, None)
    c.record_routing(True)
    generate_ids(m, _kv(m), PROMPT, max_new_tokens=8)
    prof = c.routing_profile({"prompts": "test"})
    rows = len(PROMPT) + 7
    assert prof.tokens == rows and all(sum(r) == rows * 2 for r in prof.counts)
    c.record_routing(False)
    generate_ids(m, _kv(m), PROMPT, max_new_tokens=4)
    assert c.routing_profile().counts == prof.counts               # off: nothing more counted
    slots = 9
    m2, c2 = _build(folder, slots, profile=prof)
    out = generate_ids(m2, _kv(m2), PROMPT, max_new_tokens=24).token_ids
    assert out == reference
    chosen = prof.placement(slots - c2.pool.D)
    for li, es in chosen.items():
        assert sorted(e for e in es if int(c2.pool.lookup(li, torch.tensor([e]))[0]) >= 0) == es


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_offload_kernels_in_interpreter():
    script = Path(__file__).with_name("offload_kernels_check.py")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "offload kernels ok" in r.stdout, r.stderr[-2000:]


def test_auto_takes_the_cpu_miss_path_only_when_clearly_faster():
    """The CPU path also loses the CUDA graph and syncs once per MoE layer, so near-equal probe times stream."""
    from runtime.experts import CPU_MISS_MARGIN, choose_miss_path

    assert choose_miss_path(1.0, 1.1) == "stream"                      # the H200 case: probe times within 10%
    assert choose_miss_path(1.0, CPU_MISS_MARGIN) == "stream"
    assert choose_miss_path(1.0, CPU_MISS_MARGIN * 1.01) == "cpu"
    assert choose_miss_path(2.0, 1.0) == "stream"
