"""CUDA graph capture for the fixed-width target step and the drafters' per-window work.

Why: a drafter's window or a small model's decode step is hundreds of small launches; on a GPU that is launch-bound
unless replayed as one graph. Each graph works on static buffers: scalars (anchor, position, start) go in through a
small host-to-device copy from a ring of pinned buffers, lengths are read on the device, and rows past the committed
ones write only cache slots past the committed length, which nothing reads before they are rewritten. Any failure to
build a graph turns that graph set off (recorded in `errors`), so the eager path always remains.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from runtime.gpu.fallback import fell_back

_STREAM: torch.cuda.Stream | None = None


def capture_stream() -> torch.cuda.Stream:
    """One side stream for every warm-up and capture (cuBLAS keeps a workspace per stream: one, not one each)."""
    global _STREAM
    if _STREAM is None:
        _STREAM = torch.cuda.Stream()
    return _STREAM


def capture(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up twice on the capture stream, then capture it; returns (graph, fn's output tensors)."""
    s = capture_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = fn()
    return g, out


class HostScalars:
    """A few numbers from the host into a device tensor without a host sync: a ring of pinned host buffers, each
    reused only once its last copy is done (an event, not a stream sync: the host may queue the next graph while
    the GPU still runs the previous one). Elsewhere (CPU) a plain copy."""

    def __init__(self, device: torch.device, n: int, dtype: torch.dtype = torch.long, ring: int = 4) -> None:
        self.dev = device
        self.cuda = device.type == "cuda"
        self.t = torch.zeros(n, dtype=dtype, device=device)
        self.ring = [torch.zeros(n, dtype=dtype) for _ in range(ring)]
        if self.cuda:
            self.ring = [h.pin_memory() for h in self.ring]
        # the same memory as numpy arrays: the host writes the values without a torch call each (a window's host
        # time is the GPU's idle time when the model is small)
        self.views = [h.numpy() for h in self.ring]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in self.ring]
        self.used = [False] * ring
        self.slot = 0

    def set(self, *vals: float) -> Tensor:
        i = self.slot
        self.slot = (i + 1) % len(self.ring)
        host, ev = self.ring[i], self.events[i]
        if ev is not None and self.used[i]:
            ev.synchronize()                             # this pinned buffer may still feed its last copy
        self.views[i][: len(vals)] = vals
        self.t.copy_(host, non_blocking=self.cuda)
        if ev is not None:
            ev.record()
            self.used[i] = True
        return self.t


# a graph set keeps its sampled proposals' graphs (keys ending in a sampling key) for at most this many sampling
# settings: the least recently used setting's graphs are dropped (a server's requests may each bring their own
# temperature, and each setting is a graph per draft length); the budget counts them (setup_wizard/budget.py)
SAMPLED_SETTINGS_KEPT = 2


def _setting(key: object) -> tuple | None:
    """The sampling key a graph key ends in (("chain", n, sk), ("draft", n, sk)), or None (greedy, observe)."""
    return key[-1] if isinstance(key, tuple) and len(key) >= 3 and isinstance(key[-1], tuple) else None


class GraphSet:
    """Graphs keyed by shape, replayed with scalars (anchor, position, start) and a confidence floor copied in
    through rings of pinned host buffers (`HostScalars`)."""

    def __init__(self, device: torch.device) -> None:
        self.dev = device
        self.host_scal = HostScalars(device, 3)
        self.host_floor = HostScalars(device, 1, torch.float32)
        self.scal = self.host_scal.t                                  # anchor, pos, start
        self.floor = self.host_floor.t                                # spec_min_p
        self.cuda = device.type == "cuda"   # elsewhere (tests) the same functions run eagerly, no graph
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.settings: dict[tuple, None] = {}       # sampling settings with graphs, least recently used first
        self.enabled = True
        self.errors: list[str] = []
        self.replays = 0

    def _set(self, a: int = 0, b: int = 0, c: int = 0) -> None:
        self.host_scal.set(a, b, c)

    def _set_ahead(self, anchor: Tensor, pos: int, acc: Tensor, start: int = 0) -> None:
        """Scalars of a window drafted before the host knows it: the anchor and the position pos + acc come from
        the device (the verified window's results), in stream order after the host's copy; `start` for the
        observation queued with it."""
        self.host_scal.set(0, pos, start)
        self.scal[0:1].copy_(anchor.reshape(1))
        self.scal[1:2].add_(acc.reshape(1))

    def _set_floor(self, min_p: float) -> None:
        self.host_floor.set(float(min_p))

    def _touch(self, key: object) -> None:
        """Mark `key`'s sampling setting as the most recent; drop the graphs of settings past
        SAMPLED_SETTINGS_KEPT (before a new one is captured, so they never coexist)."""
        sk = _setting(key)
        if sk is None:
            return
        self.settings.pop(sk, None)
        self.settings[sk] = None
        while len(self.settings) > SAMPLED_SETTINGS_KEPT:
            old = next(iter(self.settings))
            del self.settings[old]
            for k in [k for k in self.graphs if _setting(k) == old]:
                del self.graphs[k]

    def _run(self, key: object, fn) -> object | None:
        if not self.enabled:
            return None
        if not self.cuda:
            return fn()
        self._touch(key)
        if key not in self.graphs:
            try:
                self.graphs[key] = capture(fn)
            except Exception as e:  # fall back to the eager path for good
                fell_back(self.errors, e, f"a CUDA graph of {type(self).__name__}", "its eager path")
                self.enabled = False
                self.graphs.clear()
                self.settings.clear()
                torch.cuda.synchronize()
                return None
        g, out = self.graphs[key]
        g.replay()
        self.replays += 1
        return out


def stack_linears(mods: list) -> Tensor | None:
    """One [sum(out), in] matrix whose row blocks become the modules' weights (views: same bytes, no copy kept),
    so one matmul serves them all; None (nothing changed) unless all are plain float `nn.Linear`s alike."""
    ws = [getattr(mod, "weight", None) for mod in mods]
    if not all(type(mod) is torch.nn.Linear and mod.bias is None for mod in mods) or any(w is None for w in ws):
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or not ws[0].is_floating_point():
        return None
    return _one_matrix(ws, lambda i, view: setattr(mods[i], "weight", torch.nn.Parameter(view, requires_grad=False)))


def _one_matrix(parts: list[Tensor], put) -> Tensor:
    """The row blocks `parts` as one matrix whose views `put(i, view)` hands back to their owners; when the parts
    already are consecutive row blocks of one buffer (a second graph set stacking the same modules), a view of those
    rows (no new copy)."""
    if _consecutive(parts):
        first = parts[0].detach()
        return first.as_strided((sum(p.shape[0] for p in parts), first.shape[1]), (first.shape[1], 1))
    stacked = torch.cat([p.detach() for p in parts], dim=0)
    o = 0
    for i, p in enumerate(parts):
        put(i, stacked[o:o + p.shape[0]])
        o += p.shape[0]
    return stacked


def _consecutive(parts: list[Tensor]) -> bool:
    """Whether the 2-D row blocks `parts` lie one after the other, contiguous, in one storage (by data pointers: a
    Parameter made from a view keeps the storage but not the view's `_base`)."""
    first = parts[0]
    storage, ptr = first.untyped_storage().data_ptr(), first.data_ptr()
    for p in parts:
        if p.dim() != 2 or not p.is_contiguous() or p.dtype != first.dtype or p.shape[1] != first.shape[1] \
                or p.untyped_storage().data_ptr() != storage or p.data_ptr() != ptr:
            return False
        ptr += p.numel() * p.element_size()
    return True


class QuantStack:
    """Block-format modules of one format and input width stacked into one block matrix (their `blocks` become
    views of it: same bytes, no copy kept), applied in one product: a drafter block's few rows through the GEMV
    kernel, one launch reading each weight block once (`DRAFT_QUANT_PATH`), where separate modules would take a
    dequantization and a matmul each."""

    def __init__(self, blocks: Tensor, qtype: str, in_features: int) -> None:
        self.blocks, self.qtype, self.in_features = blocks, qtype, in_features

    def __call__(self, x: Tensor) -> Tensor:
        from runtime.formats.blocks import dequantize_torch
        from runtime.gpu import dense_kernels, moe_gemv

        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":      # the CPU: a float product
            w = dequantize_torch(self.blocks, self.qtype).to(x.dtype)
            return torch.nn.functional.linear(x, w)
        name = DRAFT_GEMV.get(self.qtype)
        cfg = moe_gemv.GEMV_VARIANTS[name] if name is not None else moe_gemv.variant(self.qtype)
        x2 = x.reshape(-1, self.in_features)
        if DRAFT_QUANT_PATH == "gemv" and cfg is not None and x2.shape[0] <= dense_kernels.GEMV_ROWS:
            return dense_kernels.gemv(x2.contiguous(), self.blocks, self.qtype, cfg).reshape(*x.shape[:-1], -1)
        return dense_kernels.quant_linear(x, self.blocks, self.qtype, self.in_features)


# a stacked block-format product of a drafter's graph: "gemv" (one launch) or "dequant" (the shared path of
# `dense_kernels.quant_linear`: a dequantization into scratch and a cuBLAS product); the benchmarks' switch. On the
# bundled heads both draft a window in 0.42-0.44 ms on an H200 (bench/results/h200_session12/final/); "gemv" reads
# each weight block once where "dequant" also writes and reads a 16-bit copy, which counts at a real head's size
DRAFT_QUANT_PATH = "gemv"
# the GEMV variant (runtime/gpu/moe_gemv.py GEMV_VARIANTS) of a stacked drafter product per block format, where it
# differs from the decode windows' (moe_gemv.DECODE_GEMV); read when a graph is captured. One-step block tiles (a
# program's 8 rows loaded whole, before the PDL wait): the bundled DFlash2 head (width 256) drafts a block of 4 in
# 0.40 ms instead of 0.42 (Q4_0), 0.42 instead of 0.44 (Q8_0) on an H200 (bench/spec_scale.py, arms "..., looped",
# bench/results/h200_session14/draft_tiles/)
DRAFT_GEMV: dict[str, str] = {"q4_0": "qone8j2", "q8_0": "qone8j2"}


def stack_quant_linears(mods: list) -> QuantStack | None:
    """`stack_linears` for `QuantLinear`s: one block matrix for all, None (nothing changed) unless all are
    bias-free block-format modules of one format, input width and device."""
    from runtime.formats.quant_linear import QuantLinear

    if not all(type(m) is QuantLinear and m.bias is None and m.qtype != "bf16" for m in mods):
        return None
    if len({(m.qtype, m.in_features, m.blocks.device, m.blocks.shape[1]) for m in mods}) != 1:
        return None
    if len(mods) == 1:
        return QuantStack(mods[0].blocks, mods[0].qtype, mods[0].in_features)
    stacked = _one_matrix([m.blocks for m in mods], lambda i, view: setattr(mods[i], "blocks", view))
    return QuantStack(stacked, mods[0].qtype, mods[0].in_features)
