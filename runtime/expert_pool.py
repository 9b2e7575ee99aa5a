"""The device side of the expert offload (docs/budget.md, "Expert cache"): a pool of expert slots on the GPU, shared by
every MoE layer, addressed through a device-side table `table[layer][expert] -> slot` (-1: not on the device).

Two kinds of slot:
- *static* slots hold the experts the routing profile chose (the most used ones); they never change;
- *dynamic* slots are a least-recently-used cache of fetched experts: a miss evicts the dynamic slot used longest
  ago and copies the missing expert there from the host arena.

`plan` does a window's bookkeeping on the device in one Triton launch (runtime/gpu/offload_kernels.py `plan`; the
same steps as shape-static torch ops where Triton is not there, and for more than 256 dynamic slots), and
`offload_kernels.fetch` copies the missing experts straight from pinned host memory, so a decode step with misses
is still one CUDA graph. A window can need at most min(rows * top_k, E) distinct experts in one layer, so a graphed
step needs at least that many dynamic slots; `rounds` serves any window with fewer (prefill) in host-driven rounds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.expert_arena import ExpertArena
from runtime.gpu import kernels, offload_kernels

_NEVER = 1 << 62      # the stamp of a position nobody may evict (the spare entry)


class SlotPool:
    def __init__(self, arena: ExpertArena, static: dict[int, list[int]], dynamic: list[tuple[int, int]],
                 n_dynamic: int, device: torch.device) -> None:
        """`static[layer]`: the experts kept for good; `dynamic`: experts to preload into the `n_dynamic` dynamic
        slots (the next most used; fewer is fine, the rest start empty)."""
        self.arena, self.device = arena, device
        self.layers = list(arena.layers)
        self.lpos = {li: j for j, li in enumerate(self.layers)}
        self.E = arena.n_exp
        L, E = len(self.layers), self.E
        n_static = sum(len(static.get(li, ())) for li in self.layers)
        self.P = n_static + n_dynamic
        self.D = n_dynamic
        self.planes = {n: torch.empty((self.P, *s), dtype=dt, device=device)
                       for n, (s, dt) in arena.plane_shapes().items()}
        table = torch.full((L * (E + 1) + 1,), -1, dtype=torch.int32)
        owner = torch.full((self.D + 1,), -1, dtype=torch.int64)
        slot = 0
        self.static_count = {li: 0 for li in self.layers}
        for li in self.layers:
            for e in sorted(static.get(li, ())):
                table[self.lpos[li] * (E + 1) + e] = slot
                self._load(li, e, slot)
                slot += 1
            self.static_count[li] = len(static.get(li, ()))
        dyn_slots = torch.arange(n_static, self.P, dtype=torch.int64)
        pre = [(li, e) for li, e in dynamic if table[self.lpos[li] * (E + 1) + e] < 0][:self.D]
        for j, (li, e) in enumerate(pre):
            key = self.lpos[li] * (E + 1) + e
            table[key] = n_static + j
            owner[j] = key
            self._load(li, e, n_static + j)
        dyn_pos = torch.full((self.P + 1,), self.D, dtype=torch.int64)
        dyn_pos[n_static:self.P] = torch.arange(self.D)
        stamp = torch.zeros(self.D + 1, dtype=torch.int64)
        stamp[self.D] = _NEVER
        self.table_flat = table.to(device)
        self.table = self.table_flat[:L * (E + 1)].view(L, E + 1)
        self.dyn_slots = dyn_slots.to(device)
        self.dyn_owner = owner.to(device)
        self.dyn_stamp = stamp.to(device)
        self.dyn_pos = dyn_pos.to(device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)     # pair hits, pair misses, experts fetched
        self.arange_e = torch.arange(E, dtype=torch.int64, device=device)
        self.fetch_kernel = (kernels.HAVE_TRITON and (device.type == "cpu" or arena.pinned))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _load(self, li: int, e: int, slot: int) -> None:
        for n, t in self.planes.items():
            t[slot].copy_(self.arena.plane(li, n)[e], non_blocking=True)

    # -------------------------------------------------------------------------------------------------- facts
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    @property
    def graphable(self) -> bool:
        """Whether a window's misses can be served inside a CUDA graph (kernel reads of the pinned arena)."""
        return self.D > 0 and self.device.type == "cuda" and self.fetch_kernel

    def need(self, pairs: int) -> int:
        """Dynamic slots one `plan` call needs for a window of `pairs` (token, choice) pairs."""
        return min(pairs, self.E)

    def resident_static(self, layer: int) -> int:
        return self.static_count[layer]

    def lookup(self, layer: int, flat: Tensor) -> Tensor:
        """Slots of `flat` expert ids (E = padding) without changing anything: -1 where not on the device."""
        return self.table[self.lpos[layer]][flat.long()].long()

    # ------------------------------------------------------------------------------------------------- planning
    def plan(self, layer: int, flat: Tensor, count: bool = True) -> Tensor:
        """Make every expert in `flat` ([NP] expert ids, E = padding) resident and return their slots (P for padding).

        On the device and shape-static: distinct missing experts (at most M = min(NP, E)) go, lowest id first, to the
        M dynamic slots used longest ago (slots this window uses are stamped now, so never evicted by it), the table
        is updated and the copies are queued. Needs D >= M."""
        E, D = self.E, self.D
        NP = flat.numel()
        M = min(NP, E)
        if M > D:
            raise RuntimeError(f"a window of {NP} pairs may need {M} staging slots; this pool has {D}.")
        lp = self.lpos[layer]
        flat = flat.reshape(-1).long()
        if self.fetch_kernel and D <= offload_kernels.PLAN_MAX_DYNAMIC and kernels.available(self.dyn_slots):
            out, cand, vslot, ok = offload_kernels.plan(
                flat.contiguous(), self.table_flat, lp * (E + 1), self.dyn_pos, self.dyn_stamp, self.dyn_owner,
                self.dyn_slots, self.clock, self.counts, E, D, self.P, M, count)
            self.fetch(layer, cand, vslot, ok)
            return out
        s = self.table[lp][flat].long()
        real = flat < E
        hit = real & (s >= 0)
        miss = real & (s < 0)
        self.clock.add_(1)
        # the dynamic slots this window hits are used now
        pos = self.dyn_pos[torch.where(hit, s, self.P)]
        self.dyn_stamp.scatter_(0, pos, self.clock.expand_as(pos))
        self.dyn_stamp[D:].fill_(_NEVER)
        # distinct missing experts, lowest id first
        mark = torch.zeros(E + 1, dtype=torch.int64, device=flat.device)
        mark.scatter_(0, torch.where(miss, flat, E), torch.ones_like(flat))
        key = mark[:E] * (2 * E) - self.arange_e
        cand = torch.topk(key, M).indices
        ok = mark[cand] > 0
        # victims: the M dynamic positions used longest ago, oldest first
        vpos = torch.topk(self.dyn_stamp[:D], M, largest=False).indices
        vslot = self.dyn_slots[vpos]
        old = self.dyn_owner[vpos]
        spare = self.table_flat.numel() - 1
        self.table_flat.scatter_(0, torch.where(ok & (old >= 0), old, spare), torch.full_like(vslot, -1, dtype=torch.int32))
        newkey = lp * (E + 1) + cand
        self.table_flat.scatter_(0, torch.where(ok, newkey, spare), vslot.to(torch.int32))
        self.table_flat[spare:].fill_(-1)
        at = torch.where(ok, vpos, D)
        self.dyn_owner.scatter_(0, at, torch.where(ok, newkey, -1))
        self.dyn_stamp.scatter_(0, at, self.clock.expand_as(at))
        self.dyn_stamp[D:].fill_(_NEVER)
        self.fetch(layer, cand, vslot, ok)
        if count:
            self.counts.add_(torch.stack([hit.sum(), miss.sum(), ok.sum()]))
        return torch.where(real, self.table[lp][flat].long(), self.P)

    def fetch(self, layer: int, experts: Tensor, slots: Tensor, ok: Tensor) -> None:
        """Queue the copies arena[layer][experts[i]] -> slots[i] for ok[i]."""
        if self.fetch_kernel and kernels.available(self.dyn_slots):
            from runtime.gpu import offload_kernels

            okf = ok.to(torch.int32)
            for n, dst in self.planes.items():
                offload_kernels.fetch(self.arena.plane(layer, n), dst, experts, slots, okf)
            return
        # host-driven: the list comes to the host (a sync), then one copy per expert and plane
        for e, s, o in zip(experts.tolist(), slots.tolist(), ok.tolist(), strict=True):
            if o:
                for n, dst in self.planes.items():
                    dst[s].copy_(self.arena.plane(layer, n)[e], non_blocking=True)

    def stats(self) -> dict[str, int]:
        h, m, f = (int(v) for v in self.counts.tolist())
        return {"pair_hits": h, "pair_misses": m, "fetched": f}

    def reset_counters(self) -> None:
        self.counts.zero_()
