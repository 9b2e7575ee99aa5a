"""The expert offload's kernel paths under TRITON_INTERPRET=1 (CPU); exits 0 and prints "offload kernels ok" when the
fetch kernel moves exactly the listed experts and every streamed path gives the all-resident kernel's bits.

Run by tests/runtime/test_expert_offload.py in a subprocess (the interpreter must be chosen before triton loads).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

import tests.runtime.kernels_check  # noqa: E402,F401  (the interpreter's loop-bound patch)


class _MaskAsBool:
    """Triton 3.9's interpreter hands its C loader an int32 mask where a block mask meets a scalar condition
    (`rows & lead`) and the loader refuses it ("mask has unsupported dtype"); compiled Triton has no such limit.
    Give the loader and storer boolean masks."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, ptrs, mask, other, dtype):
        return self._inner.load(ptrs, np.asarray(mask).astype(bool), other, dtype)

    def store(self, ptrs, value, mask):
        return self._inner.store(ptrs, value, np.asarray(mask).astype(bool))


if not isinstance(_interp._interpreter, _MaskAsBool):
    _interp._interpreter = _MaskAsBool(_interp._interpreter)

from runtime.experts import ExpertCache  # noqa: E402
from runtime.gpu import moe_kernels, offload_kernels  # noqa: E402
from runtime.gpu.static_step import StaticStep  # noqa: E402
from runtime.kv import KVCache  # noqa: E402
from runtime.loading import load_target  # noqa: E402
from runtime.speculative import generate_ids  # noqa: E402
from tests.runtime.tiny import make_tiny_target  # noqa: E402

DIR = Path(tempfile.mkdtemp())
FOLDER = make_tiny_target(DIR, mtp=False, experts=8, top_k=2, layers=2, seed=4, scale=2.0, hidden=64,
                          moe_inter=32, heads=4, kv_heads=2, head_dim=16)


def check_fetch() -> None:
    g = torch.Generator().manual_seed(0)
    for dt, shape in ((torch.float32, (6, 10, 7)), (torch.float16, (6, 3, 5)), (torch.uint8, (6, 9))):
        src = (torch.randn(*shape, generator=g) * 50).to(dt)
        dst = torch.zeros((4, *shape[1:]), dtype=dt)
        offload_kernels.fetch(src, dst, torch.tensor([5, 2, 0, 3]), torch.tensor([1, 3, 0, 2]),
                              torch.tensor([1, 1, 0, 1], dtype=torch.int32))
        assert torch.equal(dst[1], src[5]) and torch.equal(dst[3], src[2]) and torch.equal(dst[2], src[3])
        assert not dst[0].any(), "an entry with ok = 0 moved bytes"


def check_plan() -> None:
    """The one-launch plan (runtime/gpu/offload_kernels.py `plan`) against a plain-Python LRU with the documented
    order (missing experts lowest id first, victims by (stamp, position)): the table, owners, stamps, clock and
    counters after every window, each pair's slot, and the slots' bytes (the fetch of what the plan chose)."""
    from runtime.expert_arena import ExpertArena
    from runtime.expert_pool import SlotPool

    g = torch.Generator().manual_seed(7)
    layers, E, D = [0, 2], 9, 5
    arena = ExpertArena.empty(layers, E, {"gate_up": ((3, 4), torch.float32), "down": ((2,), torch.float32)})
    for li in layers:
        for t in arena.planes[li].values():
            t.copy_(torch.randn(t.shape, generator=g))
    pool = SlotPool(arena, {0: [1, 4], 2: [0]}, [(0, 2), (2, 3)], D, torch.device("cpu"))
    assert pool.fetch_kernel
    P = pool.P
    n_static = P - D
    table = pool.table_flat.clone().tolist()
    owner = pool.dyn_owner.clone().tolist()
    stamp = pool.dyn_stamp.clone().tolist()
    clock, counts = 0, [0, 0, 0]
    for step in range(40):
        li = layers[step % 2]
        lp = pool.lpos[li]
        NP = [2, 4, 5][step % 3]
        M = min(NP, E)
        flat = torch.randint(0, E + 1, (NP,), generator=g)          # E: a padded pair
        # the model
        clock += 1
        hit_pos = {pool.dyn_pos[s].item() for e in flat.tolist() if e < E and (s := table[lp * (E + 1) + e]) >= 0}
        for q in hit_pos:
            if q < D:
                stamp[q] = clock
        missing = sorted({e for e in flat.tolist() if e < E and table[lp * (E + 1) + e] < 0})[:M]
        victims = sorted(range(D), key=lambda q: (stamp[q], q))[:len(missing)]
        n_hit = sum(1 for e in flat.tolist() if e < E and table[lp * (E + 1) + e] >= 0)
        counts = [counts[0] + n_hit, counts[1] + sum(1 for e in flat.tolist() if e < E) - n_hit,
                  counts[2] + len(missing)]
        for e, q in zip(missing, victims, strict=True):
            if owner[q] >= 0:
                table[owner[q]] = -1
            table[lp * (E + 1) + e] = n_static + q
            owner[q] = lp * (E + 1) + e
            stamp[q] = clock
        want = [table[lp * (E + 1) + e] if e < E else P for e in flat.tolist()]
        got = pool.plan(li, flat).tolist()
        assert got == want, (step, got, want)
        assert pool.table_flat.tolist() == table, step
        assert pool.dyn_owner.tolist()[:D] == owner[:D] and pool.dyn_stamp.tolist()[:D] == stamp[:D], step
        assert int(pool.clock) == clock and pool.counts.tolist() == counts, step
        for e, sl in zip(flat.tolist(), got, strict=True):
            if e < E:
                for n, t in pool.planes.items():
                    assert torch.equal(t[sl], arena.plane(li, n)[e]), (step, e, sl)


def _model(slots, miss, lru=0):
    m = load_target(FOLDER)
    c = ExpertCache(m, torch.device("cpu"), slots, enforce_on_cpu=slots is not None, miss=miss, lru_slots=lru)
    c.place(m)
    if slots is None:
        for layer in m.model.layers:
            layer.mlp.stack_experts()          # the all-resident kernel path (what place() does on CUDA)
    return m, c


def check_layer_paths() -> None:
    """One MoE layer through the pool (plan + grouped kernel; rounds; CPU misses) vs moe_grouped on all experts."""
    ref_m, _ = _model(None, "auto")
    blk = ref_m.model.layers[1].mlp
    g = torch.Generator().manual_seed(1)
    for T in (1, 3, 7):
        x = torch.randn(T, 64, generator=g)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
        if T > 1:
            idx[-1] = 8                                  # a padded row
        w = torch.rand(T, 2, generator=g)
        ref = moe_kernels.moe_grouped(x, idx, w, blk.gate_up, blk.down)
        for slots, miss in ((8, "stream"), (5, "stream"), (3, "stream"), (6, "cpu")):
            m, c = _model(slots, miss)
            got = c.moe(1, x, idx, w)
            if miss == "stream":
                assert torch.equal(got, ref), (T, slots, (got - ref).abs().max())
            else:
                assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (T, slots, (got - ref).abs().max())
            st = c.stats()
            assert st["hits"] + st["misses"] == int((idx < 8).sum()), st


def check_greedy_through_step() -> None:
    """Greedy decoding through the fixed-width kernel step: the pool (streaming misses, 3 of 16 experts on the
    device) gives the token ids of the all-resident stacked run."""
    out = {}
    for name, slots in (("resident", None), ("pool", 5)):
        m, c = _model(slots, "stream")
        cfg = m.cfg
        kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64)
        step = StaticStep(m, kv, 2, graph=False)
        assert step.use_kernels
        out[name] = generate_ids(m, kv, [5, 9, 11, 2, 7, 30, 3], max_new_tokens=10, step=step).token_ids
        assert step.use_kernels and not step.errors, step.errors     # the kernels ran, no fallback
        if slots is not None:
            st = c.stats()
            assert st["misses"] > 0 and st["fetched"] > 0, st
    assert out["pool"] == out["resident"], out


if __name__ == "__main__":
    torch.set_grad_enabled(False)       # inference: the kernel paths are for no-grad only
    check_fetch()
    check_plan()
    check_layer_paths()
    check_greedy_through_step()
    print("offload kernels ok")
