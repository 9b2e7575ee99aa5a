"""The expert arena: every routed expert of every MoE layer in host RAM, in its stored format (docs/budget.md,
"Expert cache").

Per MoE layer a few named *planes*, each with the expert as its first dimension, so one expert is one row of each
plane and moving it is a plain byte copy whatever the format: BF16/fp32 targets have `gate_up` [E, 2I, H] (gate
rows, then up rows) and `down` [E, H, I]; a quantized target would have its block rows. The arena knows bytes, not
formats: the MoE kernel that reads the device copy knows the format.

On a CUDA host the planes are page-locked (`cudaHostRegister`, not torch's pinned allocator, which rounds every
request up to a power of two: 768 MiB would take 1 GiB), so host-to-device copies run at full PCIe speed and a
kernel may read an expert straight from host memory (runtime/gpu/offload_kernels.py).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device, and addressable by kernels
_REGISTER_FLAGS = 1 | 2


def _register(t: Tensor) -> bool:
    """Page-lock `t`'s memory; False when CUDA refuses (the arena then stays pageable: slower copies, no kernel
    reads)."""
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), _REGISTER_FLAGS))
    except (RuntimeError, AssertionError, AttributeError):
        return False
    return err == 0


def _unregister(ptrs: list[int], keep: list[Tensor]) -> None:
    """Unpin, then let the memory go (`keep` holds the tensors until the registrations are undone)."""
    try:
        rt = torch.cuda.cudart()
    except (RuntimeError, AssertionError, AttributeError):
        return
    for p in ptrs:
        rt.cudaHostUnregister(p)
    ptrs.clear()
    keep.clear()


class ExpertArena:
    """`planes[layer][name]`: host tensors [E, ...]; `pinned` says whether they are page-locked."""

    def __init__(self, planes: dict[int, dict[str, Tensor]]) -> None:
        if not planes:
            raise ValueError("an expert arena needs at least one MoE layer.")
        self.planes = planes
        self.layers = sorted(planes)
        first = planes[self.layers[0]]
        self.names = list(first)
        self.n_exp = next(iter(first.values())).shape[0]
        for li in self.layers:
            p = planes[li]
            if list(p) != self.names or any(t.shape[0] != self.n_exp or not t.is_contiguous() for t in p.values()):
                raise ValueError(f"MoE layer {li}: every layer needs the same contiguous planes of {self.n_exp} "
                                 f"experts.")
            for name, t in p.items():
                ref = first[name]
                if t.shape != ref.shape or t.dtype != ref.dtype:
                    raise ValueError(f"MoE layer {li}: plane {name} differs from layer {self.layers[0]}'s.")
        self.pinned = False
        self._registered: list[int] = []
        self._keep: list[Tensor] = []
        self._finalizer = weakref.finalize(self, _unregister, self._registered, self._keep)

    # -------------------------------------------------------------------------------------------- building
    @classmethod
    def empty(cls, layers: list[int], n_exp: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
              ) -> ExpertArena:
        """Uninitialised planes `shapes[name] = (per-expert shape, dtype)` for each layer (filled by the caller)."""
        return cls({li: {n: torch.empty((n_exp, *s), dtype=dt) for n, (s, dt) in shapes.items()} for li in layers})

    @classmethod
    def from_blocks(cls, blocks: dict, pin: bool = False) -> ExpertArena:
        """Move the routed experts of `blocks` ({layer: SparseMoe} on the CPU) into an arena, one layer at a time
        (the host peak grows by one layer), and make each expert's parameters views of it, so the model keeps no
        second copy and CPU code can still call `blocks[l].experts[e]`."""
        planes: dict[int, dict[str, Tensor]] = {}
        for li, blk in blocks.items():
            w0 = blk.experts[0].gate_proj.weight
            inter, hidden = w0.shape
            gu = torch.empty(blk.n_exp, 2 * inter, hidden, dtype=w0.dtype)
            dn = torch.empty(blk.n_exp, hidden, inter, dtype=w0.dtype)
            for e, ex in enumerate(blk.experts):
                gu[e, :inter].copy_(ex.gate_proj.weight.data)
                gu[e, inter:].copy_(ex.up_proj.weight.data)
                dn[e].copy_(ex.down_proj.weight.data)
            bind_experts(blk, gu, dn)
            planes[li] = {"gate_up": gu, "down": dn}
        return cls._build(planes, pin)

    @classmethod
    def from_stacks(cls, blocks: dict, pin: bool = False) -> ExpertArena:
        """The routed experts of `blocks` ({layer: SparseMoe} on the CPU) held as ggml block stacks
        (`SparseMoe.bind_blocks`): their two stacks become the planes as they are (no copy), so an expert is one row
        of bytes in each, whatever the format."""
        return cls._build({li: {"gate_up": blk.gate_up.contiguous(), "down": blk.down.contiguous()}
                            for li, blk in blocks.items()}, pin)

    @classmethod
    def _build(cls, planes: dict[int, dict[str, Tensor]], pin: bool) -> ExpertArena:
        arena = cls(planes)
        if pin:
            arena.pin()
        return arena

    def pin(self) -> bool:
        """Page-lock every plane (CUDA hosts). True when all of them are."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        ok = True
        for li in self.layers:
            for t in self.planes[li].values():
                if t.is_pinned():
                    continue
                if _register(t):
                    self._registered.append(t.data_ptr())
                    self._keep.append(t)
                else:
                    ok = False
        self.pinned = ok
        return ok

    def close(self) -> None:
        """Unpin (the memory itself goes with the last reference)."""
        self._finalizer()
        self.pinned = False

    # -------------------------------------------------------------------------------------------- reading
    def plane(self, layer: int, name: str) -> Tensor:
        return self.planes[layer][name]

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (all planes): the unit of the budget's expert cache and of every miss."""
        p = self.planes[self.layers[0]]
        return sum(t[0].numel() * t.element_size() for t in p.values())

    @property
    def nbytes(self) -> int:
        return self.expert_nbytes * self.n_exp * len(self.layers)

    def plane_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        p = self.planes[self.layers[0]]
        return {n: (tuple(t.shape[1:]), t.dtype) for n, t in p.items()}


def bind_experts(blk, gate_up: Tensor, down: Tensor) -> None:
    """Each expert's parameters become views of the stacked tensors (the storage the arena holds)."""
    inter = gate_up.shape[1] // 2
    for e, ex in enumerate(blk.experts):
        ex.gate_proj.weight.data = gate_up[e, :inter]
        ex.up_proj.weight.data = gate_up[e, inter:]
        ex.down_proj.weight.data = down[e]
