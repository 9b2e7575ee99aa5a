"""The expert cache: which routed experts live on the device, and how the others are served (docs/budget.md,
"Expert cache").

Three modes, chosen from the slots the budget gives and the miss policy:
- *resident* (every expert fits, or a CPU device): each MoE layer's experts stacked on the device, as before;
- *pool* (fewer slots than experts on CUDA): every expert in the host arena (runtime/expert_arena.py), the hottest
  ones by the routing profile in device slots (runtime/expert_pool.py), and misses served either by *streaming*
  the expert into a dynamic slot (graphable, bit-identical to the all-resident run) or on the *CPU* for the rows
  that need it (batched per layer; fp32 on a CPU device, where it is exact, BF16 on the host otherwise). `auto`
  measures both on this machine and takes the faster;
- *legacy*: the static lowest-id cache with one CPU round trip per missed expert (kept for the benchmarks).

Counters count (token, expert) pairs: rows x top_k per MoE layer. The stacked kernels of the resident mode never
tell the host which experts they used, but every real row there is a hit, so they report `count_rows(layer, n)`
from the host (no sync); the pool counts on the device and `stats()` reads it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import EXPERT_MISS
from runtime.cpu_layout import relayout
from runtime.errors import UsageError
from runtime.expert_arena import ExpertArena, bind_experts
from runtime.expert_pool import SlotPool
from runtime.gpu import kernels
from runtime.models.layers import SparseMoe
from runtime.routing_profile import RoutingProfile, RoutingRecorder, uniform_profile

MISS_POLICIES = EXPERT_MISS
KERNEL_ROWS = 64         # SparseMoe.forward's limit for the grouped kernel (more rows: the per-expert loop)


def _nbytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _stack_nbytes(blk: SparseMoe) -> int:
    """Bytes of a layer's experts held as ggml block stacks."""
    return sum(t.numel() * t.element_size() for t in (blk.gate_up, blk.down) if t is not None)


# CPU, resident experts: float linear weights held input-major (runtime/cpu_layout.py; False: as loaded)
CPU_INPUT_MAJOR = True


class ExpertCache:
    def __init__(self, model: nn.Module, device: torch.device, slots: int | None = None,
                 enforce_on_cpu: bool = False, *, miss: str = "auto", profile: RoutingProfile | None = None,
                 lru_slots: int = 0, arena: ExpertArena | None = None) -> None:
        """slots=None: all resident. On a CPU device the limit is ignored (everything is in RAM anyway) unless
        `enforce_on_cpu` (tests: emulates a partial cache on the CPU, every path included). `miss`: how experts
        off the device are served (MISS_POLICIES); `profile`: the routing profile that places the slots (None:
        evenly over the layers, lowest ids first); `lru_slots`: dynamic slots beyond what a window needs; `arena`:
        the experts already in host memory (the model's experts are views of it), else `place` makes it."""
        self.device = device
        self.blocks: dict[int, SparseMoe] = {
            i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoe)
        }
        self.n_exp = next(iter(self.blocks.values())).n_exp if self.blocks else 0
        self.top_k = next(iter(self.blocks.values())).top_k if self.blocks else 0
        self.total = self.n_exp * len(self.blocks)
        if slots is not None and slots < 0:
            raise UsageError(f"expert_slots must be >= 0, got {slots}.")
        if miss not in MISS_POLICIES:
            raise UsageError(f"unknown expert miss policy {miss!r}; use one of {', '.join(MISS_POLICIES)}.")
        if lru_slots < 0:
            raise UsageError(f"expert LRU slots must be >= 0, got {lru_slots}.")
        if (device.type != "cuda" and not enforce_on_cpu) or slots is None or slots >= self.total:
            slots = self.total
        self.slots = slots
        layers = sorted(self.blocks)
        if profile is not None and not profile.matches(layers, self.n_exp):
            raise UsageError(f"the routing profile covers MoE layers {profile.layers[:4]}... with "
                             f"{profile.n_experts} experts, not this model's; record it again (strata-setup "
                             f"calibrate).")
        self.profile = profile or uniform_profile(layers, self.n_exp)
        self.profiled = profile is not None
        self.lru_slots = int(lru_slots)
        # experts held as ggml blocks (a quantized target, `SparseMoe.bind_blocks`): the arena and the slot pool
        # move their bytes, the block kernels read them from the slots, and misses are streamed (the host paths
        # compute float experts)
        self.blocked = any(blk.fmt is not None for blk in self.blocks.values())
        self.fmt = next((blk.fmt for blk in self.blocks.values()), None) if self.blocked else None
        if self.blocked and slots < self.total and miss in ("cpu", "legacy"):
            raise UsageError(f"a quantized target serves the experts that are not on the GPU by streaming them; "
                             f"expert miss policy {miss!r} computes float experts. Set [memory] expert_miss = "
                             f"\"stream\" (or \"auto\").")
        self.mode = "resident" if slots >= self.total else ("legacy" if miss == "legacy" else "pool")
        self.miss = miss if self.mode == "pool" else "none"
        if self.blocked and self.mode == "pool":
            self.miss = "stream"
        self.probe: dict[str, Any] = {}
        self.arena: ExpertArena | None = arena
        self.pool: SlotPool | None = None
        self.window = 1
        self.recorder: RoutingRecorder | None = None
        self.hits = 0
        self.misses = 0
        self.fetched = 0
        self._resident: set[tuple[int, int]] = set()
        if self.mode == "legacy":           # the old static cache: each layer's share of slots, lowest ids
            for j, li in enumerate(layers):
                share = slots // len(layers) + (1 if j < slots % len(layers) else 0)
                self._resident.update((li, e) for e in range(min(share, self.n_exp)))
        elif self.mode == "resident":
            self._resident = {(li, e) for li in layers for e in range(self.n_exp)}
        for blk in self.blocks.values():
            blk.counter = self.count_rows
            blk.runner = self._legacy_run if self.mode != "pool" else None
            blk.offload = self.moe if self.mode == "pool" else None

    # ------------------------------------------------------------------------------------------------ placing
    def place(self, model: nn.Module) -> None:
        """Move the model to the device. Pool mode: the routed experts go to the host arena (pinned on CUDA) and
        the slot pool is filled at `ensure_window` (or the first forward); legacy: non-resident experts stay.
        On CUDA, q/k/v and each layer's experts reach the device already stacked (one allocation each), so the
        caching allocator never holds segments of the unstacked copies (docs/budget.md, "Allocator segments")."""
        cuda = self.device.type == "cuda"
        if self.mode == "pool":
            self._arena()
        stacked = None
        if self.mode == "resident" and cuda and self.blocks and not self.blocked:   # stacked on the host, then moved
            stacked = self.arena if self.arena is not None else ExpertArena.from_blocks(self.blocks, pin=False)
        mtp = getattr(model, "mtp", None)
        if cuda:
            for layer in [*model.model.layers, *(mtp.layers if mtp is not None else [])]:
                layer.self_attn.stack_qkv(self.device)    # the fused step's and the MTP graphs' one product
        off = {id(p) for li, blk in self.blocks.items() for e, ex in enumerate(blk.experts)
               if self.mode == "pool" or stacked is not None or (li, e) not in self.resident
               for p in ex.parameters()}
        for p in model.parameters():
            if id(p) not in off:
                p.data = p.data.to(self.device)
        for mod in model.modules():
            for name, b in list(mod.named_buffers(recurse=False)):
                setattr(mod, name, b.to(self.device))
        pooled = {id(b) for b in self.blocks.values()} if self.mode == "pool" else set()
        for m in model.modules():     # experts held as ggml blocks (target and MTP layer): their two stacks move
            if isinstance(m, SparseMoe) and m.fmt is not None and id(m) not in pooled:
                m.gate_up, m.down = m.gate_up.to(self.device), m.down.to(self.device)
        if cuda:
            if stacked is not None:
                for li, blk in self.blocks.items():    # the grouped Triton kernel reads them stacked (same bytes)
                    blk.bind_stacked(stacked.plane(li, "gate_up").to(self.device),
                                     stacked.plane(li, "down").to(self.device))
            elif self.mode == "legacy":
                for li, blk in self.blocks.items():
                    if all((li, e) in self.resident for e in range(blk.n_exp)):
                        blk.stack_experts()
            if mtp is not None and isinstance(mtp.layers[0].mlp, SparseMoe):
                mtp.layers[0].mlp.stack_experts()     # drafter weights, always on the device
        if self.device.type == "cpu" and self.mode == "resident":
            for blk in self.blocks.values():
                blk.pack_dense()       # a small model's experts run all at once on the CPU (SparseMoe.dense)
            if mtp is not None and isinstance(mtp.layers[0].mlp, SparseMoe):
                mtp.layers[0].mlp.pack_dense(hot=True)      # the drafter's chain: steps back to back
            for layer in [*model.model.layers, *(mtp.layers if mtp is not None else [])]:
                layer.self_attn.stack_qkv()         # the CPU step's q/k/v in one product (project_qkv)
            # BLAS's faster operand order (runtime/cpu_layout.py); not for the Triton kernels, which read weights
            # row-major (the interpreter runs them on a CPU in tests)
            if CPU_INPUT_MAJOR and not kernels.available(torch.empty(0)):
                relayout(model)
        if self.mode == "pool" and self.miss == "auto":
            self.miss = self._choose_miss_path()

    def _arena(self) -> ExpertArena:
        if self.arena is None:
            build = ExpertArena.from_stacks if self.blocked else ExpertArena.from_blocks
            self.arena = build(self.blocks, pin=self.device.type == "cuda")
        return self.arena

    def ensure_window(self, width: int) -> None:
        """Size the pool for decode/verify windows of up to `width` rows: a graphed step serves all its misses at
        once, so streaming needs min(width * top_k, E) dynamic slots (taken from the budget's slots)."""
        self.window = max(self.window, int(width))
        if self.mode != "pool":
            return
        if self.miss == "auto":            # place() was not called (tests drive the model on the CPU directly)
            self._arena()
            self.miss = self._choose_miss_path()
        if self.miss == "stream" and self.slots == 0:
            if self.blocked:
                raise UsageError("a quantized target needs at least one expert slot on the GPU to stream its "
                                 "experts into; give it more memory or a smaller size (strata-setup --target-quant).")
            self.miss = "cpu"                  # no slot to stream into: every expert is computed on the host
        need = self._dynamic_slots()
        if self.pool is not None and self.pool.D == need:
            return
        self.pool = None                            # free the old pool before the new one is made
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        n_static = self.slots - need
        rank = self.profile.ranking()
        static = self.profile.placement(n_static)
        chosen = {(li, e) for li, es in static.items() for e in es}
        pre = [(li, e) for li, e in rank if (li, e) not in chosen][:need]
        self.pool = SlotPool(self._arena(), static, pre, need, self.device)
        self._resident = chosen | set(pre)

    def _dynamic_slots(self) -> int:
        if self.miss != "stream":
            return 0
        return min(self.slots, min(self.window * self.top_k, self.n_exp) + self.lru_slots)

    def _ready(self) -> SlotPool:
        if self.pool is None:
            self.ensure_window(self.window)
        return self.pool  # type: ignore[return-value]

    @property
    def resident(self) -> set[tuple[int, int]]:
        """(layer, expert) pairs on the device now (pool mode: the static slots and what the dynamic ones hold at
        the start; they change as experts are fetched)."""
        if self.mode == "pool":
            self._ready()
        return self._resident

    @property
    def graphable(self) -> bool:
        """Whether a decode/verify step may be captured as one CUDA graph with this cache."""
        if self.mode == "resident":
            return True
        if self.mode == "legacy":
            return False
        pool = self._ready()
        return self.miss == "stream" and pool.graphable and pool.D >= pool.need(self.window * self.top_k)

    # ------------------------------------------------------------------------------------------------ serving
    def moe(self, layer: int, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """The routed experts' weighted sum for rows x [T, H] with the router's choice idx [T, k] (an id >= E marks
        a padded row: it gets 0) and weights w [T, k], whatever is resident: the same bits as the all-resident
        run on every streamed path (same kernels or same torch ops, same order)."""
        pool = self._ready()
        if self.blocked:
            return self._blocked(pool, layer, x, idx, w)
        T, k = idx.shape
        flat = idx.reshape(-1)
        if T <= KERNEL_ROWS and not torch.is_grad_enabled() and kernels.available(x):
            if self.miss == "cpu":
                return self._cpu_kernel(pool, layer, x, idx, w)
            if pool.need(T * k) <= pool.D:
                from runtime.gpu import moe_kernels

                sidx = pool.plan(layer, flat).view(T, k)
                return moe_kernels.moe_grouped(x, sidx, w, pool.planes["gate_up"], pool.planes["down"])
            return self._rounds_kernel(pool, layer, x, idx, w)
        return self._loop(pool, layer, x, idx, w)

    def _blocked(self, pool: SlotPool, layer: int, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Experts held as ggml blocks: the block kernels (or their torch reference off CUDA) read the pool's slots.
        A decode window whose misses fit the dynamic slots is planned on the device (graphable); any other window
        takes its resident experts first, then stages the missing ones D at a time into dynamic slots through the
        same kernels, so every pair gets the bits it has in the all-resident run."""
        from runtime.gpu import moe_kernels

        T, k = idx.shape
        gu, dn = pool.planes["gate_up"], pool.planes["down"]
        fast = not torch.is_grad_enabled() and kernels.available(x)
        if fast and T <= KERNEL_ROWS and pool.need(T * k) <= pool.D:
            sidx = pool.plan(layer, idx.reshape(-1)).view(T, k)
            return moe_kernels.moe_grouped(x, sidx, w, gu, dn, fmt=self.fmt)
        grouped = moe_kernels.moe_grouped if fast else moe_kernels.moe_torch
        run = moe_kernels.experts if fast else moe_kernels.experts_torch
        E = self.n_exp
        parts = []
        n = moe_kernels.PREFILL_ROWS
        for s in range(0, T, n):          # the kernels' own split, each part with a fresh slot table
            xi, ii, wi = x[s:s + n], idx[s:s + n], w[s:s + n]
            slot = pool.lookup(layer, pool.arange_e).to(torch.int32)
            on = slot.tolist()
            pairs = [e for e in ii.reshape(-1).tolist() if e < E]
            missing = sorted({e for e in pairs if on[e] < 0})
            n_miss = sum(1 for e in pairs if on[e] < 0)
            self.hits += len(pairs) - n_miss
            self.misses += n_miss

            def miss_fn(xx: Tensor, r, y: Tensor, left: list[int] = missing) -> None:
                while left:
                    staged = self._stage(pool, layer, left)
                    self.fetched += len(staged)
                    st = torch.full((E,), -1, dtype=torch.int32, device=xx.device)
                    st[list(staged)] = torch.tensor(list(staged.values()), dtype=torch.int32, device=xx.device)
                    run(xx, r, gu, dn, fmt=self.fmt, slot=st, y=y, zero_missing=False)
                    left = left[len(staged):]

            parts.append(grouped(xi, ii, wi, gu, dn, fmt=self.fmt, slot=slot, miss_fn=miss_fn if missing else None))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _loop(self, pool: SlotPool, layer: int, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Many rows (prefill) or no kernels: SparseMoe.forward's per-expert loop with each expert's weights from
        its slot. Experts on the device first (a later fetch may evict a dynamic slot), then the missing ones,
        staged D at a time (stream) or computed on the CPU (cpu); the contributions are then added in ascending
        expert order, as the loop does, so the sum has the same bits."""
        E, k = self.n_exp, idx.shape[1]
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        tok_all, slot_all = order // k, order % k
        where = pool.lookup(layer, torch.arange(E, device=flat.device)).tolist()
        spans, off = {}, 0
        for e, c in enumerate(counts[:E]):
            if c:
                spans[e] = (tok_all[off:off + c], slot_all[off:off + c])
                off += c
        contrib: dict[int, Tensor] = {}

        def run(e: int, s: int | None) -> None:
            tok, j = spans[e]
            rows = x[tok]
            if s is None:
                y = self._cpu_expert(layer, e, rows.to("cpu"), exact=x.device.type == "cpu").to(x.device)
            else:
                gu, dn = pool.planes["gate_up"][s], pool.planes["down"][s]
                inter = gu.shape[0] // 2
                y = F.linear(F.silu(F.linear(rows, gu[:inter])) * F.linear(rows, gu[inter:]), dn)
            contrib[e] = (y * w[tok, j, None]).to(x.dtype)

        missing = [e for e in spans if where[e] < 0]
        for e in spans:
            if where[e] >= 0:
                run(e, where[e])
                self.hits += counts[e]
        for e in missing:
            self.misses += counts[e]
        if self.miss == "cpu":
            for e in missing:
                run(e, None)
            missing = []
        while missing:
            staged = self._stage(pool, layer, missing)
            self.fetched += len(staged)
            for e, s in staged.items():
                run(e, s)
            missing = missing[len(staged):]
        out = torch.zeros_like(x)
        for e in sorted(contrib):
            out.index_add_(0, spans[e][0], contrib[e])
        return out

    def _stage(self, pool: SlotPool, layer: int, wanted: list[int]) -> dict[int, int]:
        """Fetch the first D of `wanted` (ascending ids) into dynamic slots; {expert: slot}."""
        if pool.D == 0:
            raise RuntimeError("the expert pool has no dynamic slots to stream misses into; use the cpu miss policy.")
        batch = wanted[:min(pool.D, self.n_exp)]
        pad = batch + [self.n_exp] * (min(pool.D, self.n_exp) - len(batch))
        got = pool.plan(layer, torch.tensor(pad, device=pool.device), count=False).tolist()
        return dict(zip(batch, got[:len(batch)], strict=True))

    def _rounds_kernel(self, pool: SlotPool, layer: int, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """A kernel-sized window needing more experts than the dynamic slots hold (a short prefill chunk): pairs of
        resident experts first, then the missing ones D at a time, all into one fp32 pair buffer summed once."""
        from runtime.gpu import offload_kernels

        E, P = self.n_exp, pool.P
        T, k = idx.shape
        flat = idx.reshape(-1).long()
        real = flat < E
        s = pool.lookup(layer, flat)
        y = torch.empty(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        gu, dn = pool.planes["gate_up"], pool.planes["down"]
        offload_kernels.pairs(x, torch.where(real & (s >= 0), s, P).view(T, k), w, gu, dn, y)
        flat_h, s_h = flat.tolist(), s.tolist()
        missing = sorted({e for e, sl in zip(flat_h, s_h, strict=True) if e < E and sl < 0})
        self.hits += sum(1 for e, sl in zip(flat_h, s_h, strict=True) if e < E and sl >= 0)
        self.misses += sum(1 for e, sl in zip(flat_h, s_h, strict=True) if e < E and sl < 0)
        while missing:
            staged = self._stage(pool, layer, missing)
            self.fetched += len(staged)
            missing = missing[len(staged):]
            m = torch.full((E + 1,), P, dtype=torch.long, device=x.device)
            m[list(staged)] = torch.tensor(list(staged.values()), dtype=torch.long, device=x.device)
            offload_kernels.pairs(x, m[flat.clamp(max=E)].view(T, k), w, gu, dn, y)
        return offload_kernels.pair_sum(y, real, T, k, x.dtype)

    def _cpu_kernel(self, pool: SlotPool, layer: int, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """cpu policy, kernel-sized window: resident pairs on the device while the host computes the missing ones
        (all of this layer's, batched), then one sum in top-k order."""
        from runtime.gpu import offload_kernels

        E, P = self.n_exp, pool.P
        T, k = idx.shape
        flat = idx.reshape(-1).long()
        real = flat < E
        s = pool.lookup(layer, flat)
        miss = real & (s < 0)
        mi = miss.nonzero().flatten()                              # host sync: which pairs the CPU serves
        rows_h = x[mi // k].to("cpu") if mi.numel() else None
        y = torch.empty(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        offload_kernels.pairs(x, torch.where(real & (s >= 0), s, P).view(T, k), w, pool.planes["gate_up"],
                              pool.planes["down"], y)
        n_miss = int(mi.numel())
        self.misses += n_miss
        self.hits += int(real.sum()) - n_miss
        if n_miss:
            ex = flat[mi].tolist()
            wt = w.reshape(-1)[mi].float().cpu()
            y_h = torch.empty(n_miss, x.shape[1], dtype=torch.float32)
            for e in sorted(set(ex)):
                sel = [i for i, v in enumerate(ex) if v == e]
                y_h[sel] = self._cpu_expert(layer, e, rows_h[sel], exact=False).float() * wt[sel, None]
            y.index_copy_(0, mi, y_h.to(x.device, non_blocking=True))
        return offload_kernels.pair_sum(y, real, T, k, x.dtype)

    def _cpu_expert(self, layer: int, e: int, rows: Tensor, exact: bool) -> Tensor:
        return cpu_expert(self._arena(), layer, e, rows, exact)

    def _legacy_run(self, layer: int, e: int, rows: Tensor) -> Tensor:
        expert = self.blocks[layer].experts[e]
        if (layer, e) in self.resident:
            self.hits += rows.shape[0]
            return expert(rows)
        self.misses += rows.shape[0]
        wt = expert.gate_proj.weight
        y = expert(rows.to(wt.device, wt.dtype))
        return y.to(rows.device, rows.dtype)

    # alias kept for callers of the old API
    run = _legacy_run

    def use_profile(self, profile: RoutingProfile) -> bool:
        """Place the slots by `profile` from now on; True when the device copy changed (pool mode: the pool is
        rebuilt, its old tensors freed first)."""
        if not profile.matches(sorted(self.blocks), self.n_exp):
            raise UsageError("the routing profile does not match this model's MoE layers; record it again "
                             "(strata-setup calibrate).")
        self.profile, self.profiled = profile, True
        if self.mode != "pool" or self.pool is None:
            return False
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.ensure_window(self.window)
        return True

    def release(self) -> None:
        """Give back the device copies of the experts and point the experts at the arena again, hooks off
        (benchmarks build several caches, one after another, on one model and arena)."""
        self.pool = None
        for li, blk in self.blocks.items():
            blk.offload = blk.runner = blk.counter = blk.recorder = None
            if self.blocked:              # block stacks: the arena's planes are the stacks (host)
                if self.arena is not None:
                    blk.gate_up, blk.down = self.arena.plane(li, "gate_up"), self.arena.plane(li, "down")
                continue
            blk.gate_up = blk.down = None
            if self.arena is not None:
                bind_experts(blk, self.arena.plane(li, "gate_up"), self.arena.plane(li, "down"))

    # ------------------------------------------------------------------------------------------ the miss path
    def _choose_miss_path(self) -> str:
        """Measure, on this machine, seconds per missed expert when streamed to the device and when computed on the
        CPU for one row; take the faster (a CPU device: stream, which is what the GPU would do)."""
        if self.device.type != "cuda":
            return "stream"
        self.probe = measure_miss_paths(self._arena(), self.device)
        return self.probe["choice"]

    # ---------------------------------------------------------------------------------------------- profiling
    def record_routing(self, on: bool = True) -> None:
        """Count the router's choices of every MoE layer from now on (off: stop; the counts stay)."""
        if on and self.recorder is None:
            self.recorder = RoutingRecorder(sorted(self.blocks), self.n_exp, self.device, self.top_k)
        for blk in self.blocks.values():
            blk.recorder = self.recorder.add if (on and self.recorder is not None) else None

    def routing_profile(self, meta: dict[str, Any] | None = None) -> RoutingProfile:
        if self.recorder is None:
            raise RuntimeError("routing was not recorded; call record_routing() before generating.")
        return self.recorder.profile(meta)

    # ------------------------------------------------------------------------------------------------- counting
    def count_rows(self, layer: int, n: int) -> None:
        """`n` real rows went through layer `layer` on the stacked (all-resident) path: n x top_k hits."""
        blk = self.blocks.get(layer)
        if blk is not None and self.mode != "pool":
            self.hits += int(n) * blk.top_k

    @property
    def resident_nbytes(self) -> int:
        """Bytes of the expert weights held on the device (on CPU-only machines: all experts)."""
        if self.mode == "pool":
            return self._ready().nbytes
        if self.blocked:
            return sum(_stack_nbytes(blk) for blk in self.blocks.values())
        return sum(_nbytes(self.blocks[li].experts[e]) for li, e in self.resident)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert (the budget's unit)."""
        blk = next(iter(self.blocks.values()), None)
        if blk is not None and self.blocked:
            return _stack_nbytes(blk) // blk.n_exp
        return _nbytes(blk.experts[0]) if blk is not None else 0

    def expected_hit_rate(self) -> float:
        return self.profile.expected_hit_rate(self.slots)

    def stats(self) -> dict[str, int | float]:
        hits, misses, fetched = self.hits, self.misses, self.fetched
        if self.pool is not None:
            d = self.pool.stats()
            hits += d["pair_hits"]
            misses += d["pair_misses"]
            fetched += d["fetched"]
        calls = hits + misses
        out: dict[str, Any] = {"slots": self.slots, "experts": self.total, "hits": hits, "misses": misses,
                               "hit_rate": (hits / calls) if calls else 1.0, "mode": self.mode, "miss_path": self.miss,
                               "fetched": fetched, "fetched_bytes": fetched * self.expert_nbytes}
        if self.pool is not None:
            out["dynamic_slots"] = self.pool.D
        return out

    def reset_counters(self) -> None:
        self.hits = self.misses = self.fetched = 0
        if self.pool is not None:
            self.pool.reset_counters()


def cpu_expert(arena: ExpertArena, layer: int, e: int, rows: Tensor, exact: bool) -> Tensor:
    """One expert on the host from the arena, for host rows [n, H]. `exact`: the resident computation's ops (a CPU
    device, where the result then has the same bits); else one gate/up matmul in the arena's dtype."""
    gu = arena.plane(layer, "gate_up")[e]
    dn = arena.plane(layer, "down")[e]
    inter = gu.shape[0] // 2
    r = rows.to(gu.dtype)
    if exact:
        return F.linear(F.silu(F.linear(r, gu[:inter])) * F.linear(r, gu[inter:]), dn)
    a = F.linear(r, gu).float()
    return F.linear((F.silu(a[:, :inter]) * a[:, inter:]).to(gu.dtype), dn)


def measure_miss_paths(arena: ExpertArena, device: torch.device, n: int = 4, repeats: int = 3) -> dict[str, Any]:
    """Seconds per missed expert on this machine: streamed (host arena -> device, the path a graphed step uses:
    the fetch kernel when the arena is pinned, else a copy) vs computed on the CPU for one row. Small (n experts of
    one layer) and its device buffers are returned to the driver, so it leaves the memory budget as it was."""
    li = arena.layers[0]
    n = min(n, arena.n_exp)
    out: dict[str, Any] = {"experts": n, "expert_bytes": arena.expert_nbytes, "pinned": arena.pinned}
    ids = torch.arange(n, device=device)
    ok = torch.ones(n, dtype=torch.int32, device=device)
    bufs = {name: torch.empty((n, *s), dtype=dt, device=device) for name, (s, dt) in arena.plane_shapes().items()}
    use_kernel = arena.pinned and kernels.HAVE_TRITON

    def stream() -> None:
        if use_kernel:
            from runtime.gpu import offload_kernels

            for name, b in bufs.items():
                offload_kernels.fetch(arena.plane(li, name), b, ids, ids, ok)
        else:
            for name, b in bufs.items():
                b.copy_(arena.plane(li, name)[:n], non_blocking=True)

    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        stream()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    out["stream_s_per_expert"] = statistics.median(times[1:]) / n
    out["stream_GBps"] = arena.expert_nbytes / out["stream_s_per_expert"] / 1e9
    out["stream_via"] = "kernel" if use_kernel else "copy"
    bufs.clear()
    torch.cuda.empty_cache()
    hidden = arena.plane(li, "gate_up").shape[-1]
    row = torch.randn(1, hidden, dtype=arena.plane(li, "gate_up").dtype)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for e in range(n):
            cpu_expert(arena, li, e, row, exact=False)
        times.append(time.perf_counter() - t0)
    out["cpu_s_per_expert"] = statistics.median(times[1:]) / n
    out["cpu_GBps"] = arena.expert_nbytes / out["cpu_s_per_expert"] / 1e9
    out["choice"] = choose_miss_path(out["cpu_s_per_expert"], out["stream_s_per_expert"])
    return out


# auto takes the CPU miss path only when the host computes a missed expert this many times faster than it streams:
# the CPU path also gives up the step's CUDA graph and waits for the host once per MoE layer, which the per-expert
# probe does not see (H200, A3B at a 24 GiB budget: probe times within 10% of each other, 5.3 tok/s on the CPU path
# against 17.7 streamed)
CPU_MISS_MARGIN = 2.0


def choose_miss_path(cpu_s_per_expert: float, stream_s_per_expert: float) -> str:
    return "cpu" if cpu_s_per_expert * CPU_MISS_MARGIN < stream_s_per_expert else "stream"
