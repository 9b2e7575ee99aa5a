"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (docs/models.md, "Launches").

Why: a decode step of the Qwen3-30B-A3B shape is about 640 launches of 1.5-20 us each, in a CUDA graph; between two
of them the GPU drains the first grid, then launches and ramps up the next. On Hopper (compute capability 9.0) a
kernel launched with the programmatic-serialization attribute may be scheduled while the kernel before it in the
stream still runs: its programs start, then wait (`griddepcontrol.wait`) until that kernel has finished and its
writes are visible. The wait comes before a program reads anything another kernel writes and before it writes
anything, so the results are the same bits with and without PDL; only the launch latency and the ramp overlap the
previous kernel's tail. Stream capture keeps the attribute as a programmatic edge of the graph.

Every kernel that takes `GDC` calls `start(GDC)` first: wait for the previous kernel, then let the next one be
scheduled (`griddepcontrol.launch_dependents`). Because every PDL kernel waits for its predecessor and kernels
launched without PDL (cuBLAS, torch) wait for everything before them, each kernel still sees all earlier kernels
done. `launch(t)` gives the launch options for a kernel on tensor t's device: the attribute and GDC=True on a CUDA
device of capability 9.0 or more with a Triton that launches with PDL (probed once), else GDC=False and a plain
launch (the CPU interpreter, older GPUs, `ENABLED = False`).

A kernel of a TRIGGER_FIRST part lets the next kernel be scheduled before its own wait: the next kernel's programs
can then start while this one still waits for the one before, so a kernel two launches ahead (o_proj behind the
split attention's reduction) loads its weights early. Each kernel still waits for its predecessor, which waited
for its own, so every kernel still sees all earlier ones done; but the next kernel must not read, before its wait,
anything the kernel before a TRIGGER_FIRST one writes (the EARLY loads read weights and constant tables only; the
gate/up kernel, whose routing the down products read early, is never a TRIGGER_FIRST part).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from runtime.gpu.kernels import FMA, HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# on, except for the split attention. H200, A3B shape (bench/step_ab.py, bench/results/h200_session6/final/): the
# one-row BF16 step 3.25 -> 3.19 ms at 1k context and 4.31 -> 4.24 at 32k (with PDL on the attention kernels too:
# 3.13 and 4.39), an 8-row step 0.7% faster, a Q4_0 one-row step 1-1.5% slower, prefill unchanged. On the reduction
# (so the o_proj product after it starts loading its weights): 2.72 -> 2.69 ms at 1k, 3.79 -> 3.73 at 32k
# (bench/results/h200_session8/); the benchmarks switch PDL off to measure the step without it
ENABLED = True
# parts launched without PDL even when ENABLED: "attention" (the split kernel), "attention_reduce" (its reduction),
# "prefill" (the MoE kernels on prefill chunks); "attention:o_early" and "attention_reduce:o_early" are the same
# kernels where the o_proj product after them loads its weights before its wait (`attention_kernels.attention`'s
# o_early). The split kernel launches without PDL (with PDL alone the one-row step was 1.5-2% slower from 4k context
# on), except before such an o_proj (below)
SKIP: set[str] = {"attention"}
# parts whose kernels let the next kernel be scheduled before their own wait (module docstring): the reduction
# before an o_proj that loads early (with the split kernel before it on PDL), so the o_proj product's programs load
# their weights while the split attention still runs. H200, A3B one-row BF16 step (bench/step_ab.py, three runs in
# bench/results/h200_session15/: trigger/, trigger_confirm/, o_early/): 2.62-2.63 -> 2.61 ms at 1k, 2.69-2.70 ->
# 2.67-2.68 at 4k, 3.15-3.16 -> 3.10 at 16k, 3.61 -> 3.58-3.59 at 32k (the split kernel on PDL alone: 2.61 / 2.76 /
# 3.19 / 3.67); the q/k/v
# post-processing, the split kernel, the routing or the down products first too: no better (arms trig-*). Not
# before a quantized target's o_proj (looped tiles, no early loads): there the same launches made the one-row step at
# 16k context 2.70 -> 2.81 ms (Q4_0) and 3.01 -> 3.24 (Q8_0)
TRIGGER_FIRST: set[str] = {"attention_reduce:o_early"}
# the split attention's working programs mark their SM in a table before their wait, and a one-row o_proj of the
# "AWARE" form whose program finds its SM marked loads its weights after its wait instead of before, so its early
# loads do not queue ahead of the attention's K/V reads on that SM (bench/step_ab.py arm o-aware; off: the split marks
# nothing). The table is a hint only: no value a kernel computes depends on it. MARK_MAX > 0: the split marks only
# while at most that many of its programs work (a short context); H100: o-aware 3.06 -> 3.01 ms at 1k, but 3.07 ->
# 3.20 at 4k, where nearly every SM is marked (bench/results/h100_session38/)
MARK_SMS = False
MARK_MAX = 0
_MARKS: dict[str, Tensor] = {}
_PROBED: dict[int, bool] = {}
PROBE_ERRORS: list[str] = []     # why a probe found no PDL (for the benchmarks' reports)
_OFF = {"GDC": False, **FMA}
_ON = {"GDC": True, "launch_pdl": True, **FMA}
_ON_FIRST = {"GDC": 2, "launch_pdl": True, **FMA}

if HAVE_TRITON:

    @triton.jit
    def _wait_asm():
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _launch_asm():
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)

    @triton.jit
    def start(GDC: tl.constexpr):
        """Wait until the previous kernel in the stream is done and its writes are visible, then allow the next
        kernel to be scheduled (GDC 2, a TRIGGER_FIRST part: allow it first, then wait). A no-op without PDL (GDC
        False: the interpreter never sees the PTX)."""
        if GDC == 2:
            _launch_asm()
            _wait_asm()
        elif GDC:
            _wait_asm()
            _launch_asm()

    @triton.jit
    def wait(GDC: tl.constexpr):
        """`start` for a kernel that lets the next one be scheduled later, with `release`: the wait alone (a
        TRIGGER_FIRST part, GDC 2: `start` as it is, the next kernel let in first)."""
        if GDC == 2:
            start(GDC)
        elif GDC:
            _wait_asm()

    @triton.jit
    def let_in(GDC: tl.constexpr):
        """Let the next kernel be scheduled now (a kernel that waits later with `wait_only`): its programs may then
        start before this kernel's loads; it still waits for this kernel to end."""
        if GDC:
            _launch_asm()

    @triton.jit
    def wait_only(GDC: tl.constexpr):
        """The wait alone, for a kernel that let the next one in with `let_in`."""
        if GDC:
            _wait_asm()

    @triton.jit
    def sm_id(GDC: tl.constexpr):
        """The SM this program runs on (0 where no PTX runs: the interpreter, GDC False)."""
        if GDC:
            return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return 0

    @triton.jit
    def release(GDC: tl.constexpr):
        """After `wait` and a kernel's arithmetic: let the next kernel be scheduled (GDC 2 let it in at `wait`).
        Placed there, a tile loaded before the wait costs far fewer registers than with `start`'s instruction between
        the loads and the sums (runtime/gpu/moe_gemv.py `_one_dense_kernel`: 86 registers a thread against 156 on
        sm_90, Triton 3.6)."""
        if GDC == 1:
            _launch_asm()

    @triton.jit
    def _probe_kernel(x_ptr, GDC: tl.constexpr):
        start(GDC)
        tl.store(x_ptr + tl.arange(0, 32), tl.load(x_ptr + tl.arange(0, 32)) + 1.0)


def _probe(device: torch.device) -> bool:
    """True when this Triton launches a kernel with PDL on `device` and it computes (checked once per device, never
    inside a capture: the warm-up before a capture probes)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _PROBED:
        return _PROBED[idx]
    if torch.cuda.is_current_stream_capturing():
        return False
    ok = False
    if torch.cuda.get_device_capability(idx)[0] >= 9:
        try:
            x = torch.zeros(32, dtype=torch.float32, device=device)
            _probe_kernel[(1,)](x, **_ON)
            _probe_kernel[(1,)](x, **_ON)
            ok = bool((x == 2.0).all().item())
        except Exception as e:  # a Triton without launch_pdl, or a driver that refuses the attribute
            PROBE_ERRORS.append(f"{type(e).__name__}: {str(e)[:200]}")
    _PROBED[idx] = ok
    return ok


def sm_marks(t: Tensor) -> Tensor:
    """The SM mark table of t's device (MARK_SMS): one int32 a possible SM id, zero until a split program marks it.
    Made outside a CUDA graph's capture (the benchmarks ask for it first), so no graph holds its zeroing."""
    key = str(t.device)
    if key not in _MARKS:
        _MARKS[key] = torch.zeros(1024, dtype=torch.int32, device=t.device)
    return _MARKS[key]


def launch(t: Tensor, part: str = "") -> dict:
    """The PDL launch options for a kernel whose tensors live on t's device (module docstring); `part` names the
    kernel's group for SKIP."""
    if not (ENABLED and HAVE_TRITON and t.is_cuda) or part in SKIP or os.environ.get("TRITON_INTERPRET") == "1":
        return _OFF
    if not _probe(t.device):
        return _OFF
    return _ON_FIRST if part in TRIGGER_FIRST else _ON
