"""Kernels of the expert offload (docs/budget.md, "Expert cache"):

- `fetch`: copy whole experts from the host arena into device slots, with the (expert, slot) list on the device. The
  kernel reads page-locked host memory directly over PCIe (no host round trip, no host-side launch per expert), so
  the miss path is a fixed set of launches that a CUDA graph can hold. An entry whose `ok` flag is 0 copies nothing.
- `plan`: a window's slot bookkeeping (runtime/expert_pool.py `SlotPool.plan`) in one launch: look the pairs up,
  stamp the dynamic slots they hit, pick the distinct missing experts (lowest id first) and the dynamic slots used
  longest ago, update the table, owners and stamps, and return each pair's slot. The same steps as the torch ops of
  `SlotPool.plan`, which a decode step otherwise pays as some 25 launches per MoE layer.
- `pairs` / `pair_sum`: the grouped expert kernels of runtime/gpu/moe_kernels.py split at their fp32 per-(token,
  choice) buffer `y`, so (token, expert) pairs can be computed in several passes (a window needing more experts than
  the staging slots hold) or partly elsewhere (the CPU), and still be summed in one pass in top-k order: every pair
  gets exactly the bits `moe_grouped` would give it, whatever pass or slot it went through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu import moe_kernels
from runtime.gpu.kernels import FMA, HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

FETCH_CHUNK = 32768       # words (of the widest type that divides an expert's row) per program
FETCH_BLOCK = 1024        # words per load/store step


if HAVE_TRITON:

    @triton.jit
    def _fetch_kernel(src_ptr, dst_ptr, exp_ptr, slot_ptr, ok_ptr, n_words, src_stride, dst_stride,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c = tl.program_id(1)
        lim = tl.load(ok_ptr + i).to(tl.int64) * n_words     # ok is 0 or 1: a skipped entry has no valid word
        e = tl.load(exp_ptr + i).to(tl.int64)
        s = tl.load(slot_ptr + i).to(tl.int64)
        base = c.to(tl.int64) * CHUNK
        for o in range(0, CHUNK, BLOCK):
            offs = base + o + tl.arange(0, BLOCK)
            m = offs < lim                     # masked-off lanes issue no reads (a skipped entry moves nothing)
            v = tl.load(src_ptr + e * src_stride + offs, mask=m)
            tl.store(dst_ptr + s * dst_stride + offs, v, mask=m)


    @triton.jit
    def _plan_kernel(flat_ptr, table_ptr, dyn_pos_ptr, dyn_stamp_ptr, dyn_owner_ptr, dyn_slots_ptr, clock_ptr,
                     counts_ptr, out_ptr, cand_ptr, vslot_ptr, ok_ptr, NP, lb, E, D, P, M,
                     BNP: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, COUNT: tl.constexpr):
        i = tl.arange(0, BNP)
        im = i < NP
        f = tl.load(flat_ptr + i, mask=im, other=E)
        real = f < E
        s = tl.load(table_ptr + lb + f, mask=im, other=-1)            # entry E of a layer's row is always -1
        hit = real & (s >= 0)
        miss = real & (s < 0)
        clock = tl.load(clock_ptr) + 1
        tl.store(clock_ptr, clock)
        # the dynamic slots this window hits are used now
        pos = tl.load(dyn_pos_ptr + tl.where(hit, s, P), mask=im, other=D)
        tl.store(dyn_stamp_ptr + pos, tl.zeros_like(pos) + clock, mask=hit & (pos < D))
        tl.debug_barrier()
        # distinct missing experts, lowest id first: rank among the marked ids
        e = tl.arange(0, BE)
        eq = (f[:, None] == e[None, :]) & miss[:, None]
        mark = tl.where(e < E, tl.max(eq.to(tl.int32), 0), 0)
        rank = tl.cumsum(mark, 0) - 1
        n_new = tl.sum(mark, 0)
        j = tl.arange(0, BM)
        sel = (rank[None, :] == j[:, None]) & (mark[None, :] > 0)
        cand = tl.sum(tl.where(sel, e[None, :], 0), 1)
        ok = (j < n_new) & (j < M)
        # victims: dynamic positions ordered by (stamp, position), oldest first; the j-th one for candidate j
        d = tl.arange(0, BD)
        dm = d < D
        st = tl.load(dyn_stamp_ptr + d, mask=dm, other=0)
        before = ((st[None, :] < st[:, None]) | ((st[None, :] == st[:, None]) & (d[None, :] < d[:, None]))) \
            & dm[None, :]
        order = tl.sum(before.to(tl.int32), 1)                          # each position's place in that order
        pick = (order[None, :] == j[:, None]) & dm[None, :]
        vpos = tl.sum(tl.where(pick, d[None, :], 0), 1)
        vslot = tl.load(dyn_slots_ptr + vpos, mask=ok, other=0)
        old = tl.load(dyn_owner_ptr + vpos, mask=ok, other=-1)
        tl.debug_barrier()
        tl.store(table_ptr + old, tl.zeros_like(old) - 1, mask=ok & (old >= 0))
        tl.debug_barrier()
        key = lb + cand
        tl.store(table_ptr + key, vslot.to(tl.int32), mask=ok)
        tl.store(dyn_owner_ptr + vpos, key.to(tl.int64), mask=ok)
        tl.store(dyn_stamp_ptr + vpos, tl.zeros_like(vpos).to(tl.int64) + clock, mask=ok)
        tl.debug_barrier()
        s2 = tl.load(table_ptr + lb + f, mask=im, other=-1)
        tl.store(out_ptr + i, tl.where(real, s2.to(tl.int64), P), mask=im)
        jm = j < M
        tl.store(cand_ptr + j, cand.to(tl.int64), mask=jm)
        tl.store(vslot_ptr + j, vslot, mask=jm)
        tl.store(ok_ptr + j, ok.to(tl.int32), mask=jm)
        if COUNT:
            tl.store(counts_ptr, tl.load(counts_ptr) + tl.sum(hit.to(tl.int64), 0))
            tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + tl.sum(miss.to(tl.int64), 0))
            tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + tl.sum(ok.to(tl.int64), 0))


def _words(t: Tensor) -> Tensor:
    """`t` [N, ...] (contiguous) as [N, words] of the widest integer type that divides one row."""
    n = t.shape[0]
    row = t[0].numel() * t.element_size()
    b = t.reshape(n, -1).view(torch.uint8)
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % size == 0:
            return b.view(dt)
    return b


def fetch(src: Tensor, dst: Tensor, experts: Tensor, slots: Tensor, ok: Tensor) -> None:
    """dst[slots[i]] = src[experts[i]] for every i with ok[i] != 0 (src: host plane [E, ...], pinned; dst: device
    plane [P, ...]; experts/slots int [M]; ok int32 [M] of 0 or 1). Shape-static: the grid is M x chunks of one expert."""
    s, d = _words(src), _words(dst)
    n = s.shape[1]
    grid = (experts.numel(), triton.cdiv(n, FETCH_CHUNK))
    _fetch_kernel[grid](s, d, experts, slots, ok, n, s.stride(0), d.stride(0), CHUNK=FETCH_CHUNK, BLOCK=FETCH_BLOCK,
                        num_warps=4, **FMA)


def pairs(x: Tensor, sidx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, y: Tensor) -> None:
    """y[t*k + j] = w[t, j] * expert(x[t]) for every pair whose slot sidx[t, j] < P (gate_up/down [P, ...]); other
    rows of y are left as they are. The same kernels, tiles and row block as `moe_kernels.moe_grouped`."""
    r = moe_kernels.group(sidx, w, gate_up.shape[0])
    moe_kernels.experts(x, r, gate_up, down, y=y, zero_missing=False)


def pair_sum(y: Tensor, real: Tensor, T: int, k: int, dtype: torch.dtype) -> Tensor:
    """out[t] = sum over j (in top-k order) of y[t*k + j] for the real pairs (real [T*k] bool), in `dtype`: the sum
    `moe_grouped` ends with."""
    flag = (~real).to(torch.int32).reshape(T, k).contiguous()     # 0 = real pair (< n_exp = 1), 1 = padded
    return moe_kernels.combine(y, flag, 1, None, dtype)


PLAN_MAX_DYNAMIC = 256     # the plan kernel orders the dynamic slots in one [D, D] tile; more: the torch ops


def plan(flat: Tensor, table: Tensor, lb: int, dyn_pos: Tensor, dyn_stamp: Tensor, dyn_owner: Tensor,
         dyn_slots: Tensor, clock: Tensor, counts: Tensor, E: int, D: int, P: int, M: int,
         count: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One launch of `SlotPool.plan`'s bookkeeping for the pairs `flat` ([NP] int64 expert ids, E = padding) of the
    layer whose table row starts at `lb`: (each pair's slot, P for padding; the M candidate experts, their slots and
    ok flags for `fetch`). Needs M <= D <= PLAN_MAX_DYNAMIC."""
    NP = flat.numel()
    dev = flat.device
    out = torch.empty(NP, dtype=torch.int64, device=dev)
    cand = torch.empty(M, dtype=torch.int64, device=dev)
    vslot = torch.empty(M, dtype=torch.int64, device=dev)
    ok = torch.empty(M, dtype=torch.int32, device=dev)
    _plan_kernel[(1,)](flat, table, dyn_pos, dyn_stamp, dyn_owner, dyn_slots, clock, counts, out, cand, vslot, ok,
                       NP, lb, E, D, P, M, BNP=triton.next_power_of_2(max(NP, 2)),
                       BE=triton.next_power_of_2(E + 1), BD=triton.next_power_of_2(max(D, 2)),
                       BM=triton.next_power_of_2(max(M, 2)), COUNT=bool(count), num_warps=4, **FMA)
    return out, cand, vslot, ok
