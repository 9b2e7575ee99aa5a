"""What this machine has: GPUs (through torch), RAM and free disk. A plain dataclass so tests can inject one."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from runtime.hostinfo import cpu_name, ram_bytes

MIB = 1 << 20


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class Hardware:
    """One snapshot. `device_type` is "cuda" when a GPU is usable, else "cpu" (budget against RAM)."""

    gpus: tuple[GPU, ...] = ()
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    disk_free_bytes: int = 0
    cpu_count: int = 1
    cpu_name: str = "cpu"
    notes: tuple[str, ...] = field(default_factory=tuple)
    vram_limit_mib: int | None = None  # --vram-limit-mib: the first GPU is treated as a card of this size
    links: tuple[float, float] | None = None  # measured (device copy, pinned host-to-device) bytes/s: `measure_links`

    @property
    def device_type(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def device_name(self) -> str:
        return self.gpus[0].name if self.gpus else self.cpu_name

    @property
    def total_bytes(self) -> int:
        """The memory the budget is drawn from: the first GPU, or RAM on a CPU-only machine."""
        return self.gpus[0].total_bytes if self.gpus else self.ram_total_bytes

    @property
    def free_bytes(self) -> int:
        return self.gpus[0].free_bytes if self.gpus else self.ram_available_bytes

    @property
    def runtime_dtype(self) -> str:
        """bf16 on CUDA, fp32 on CPU (what the runtime uses unless the config says otherwise)."""
        return "bf16" if self.gpus else "fp32"

    def describe(self) -> str:
        if self.gpus:
            g = self.gpus[0]
            return (f"{g.name} ({g.total_bytes / MIB:,.0f} MiB, {g.free_bytes / MIB:,.0f} MiB free, "
                    f"sm_{g.capability[0]}{g.capability[1]})")
        return f"CPU only ({self.cpu_count} cores, {self.ram_available_bytes / MIB:,.0f} MiB RAM available)"

    def with_vram_limit(self, limit_mib: int | None) -> Hardware:
        """This machine as if its first GPU had `limit_mib` MiB (`--vram-limit-mib`: a shared card, or a smaller
        card emulated): its total and free memory are capped; the runtime enforces the same cap on its allocator
        (runtime/memory.py `cap_device_memory`)."""
        if limit_mib is None:
            return self
        from runtime.errors import UsageError

        if limit_mib <= 0:
            raise UsageError(f"--vram-limit-mib must be a positive number of MiB, got {limit_mib}.")
        if not self.gpus:
            raise UsageError("--vram-limit-mib caps GPU memory, but no CUDA GPU is usable here; drop the flag.")
        g = self.gpus[0]
        lim = int(limit_mib) * MIB
        if lim > g.total_bytes:
            raise UsageError(f"--vram-limit-mib {limit_mib} is more than the GPU's {g.total_bytes // MIB} MiB; "
                             f"pass at most {g.total_bytes // MIB}.")
        capped = replace(g, total_bytes=lim, free_bytes=min(g.free_bytes, lim))
        return replace(self, gpus=(capped, *self.gpus[1:]), vram_limit_mib=int(limit_mib),
                       notes=(*self.notes, f"GPU memory capped at {limit_mib} MiB (--vram-limit-mib)."))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device_type"] = self.device_type
        d["device_name"] = self.device_name
        return d


def measure_links(device: int = 0, nbytes: int = 128 * MIB, repeats: int = 3) -> tuple[float, float] | None:
    """The first GPU's device-memory copy bandwidth (bytes read plus written per second, as the benchmarks count
    it) and its pinned host-to-device copy bandwidth, medians of a few copies; None without a usable GPU. Used for
    the decode estimate of an offloaded setup (setup_wizard/budget.py `decode_estimate`); about a quarter second."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda", device)
        a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

        def timed(dst, src) -> float:
            out = []
            for _ in range(repeats + 1):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                dst.copy_(src, non_blocking=True)
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) / 1e3)
            return sorted(out[1:])[len(out[1:]) // 2]

        d2d = 2 * nbytes / timed(b, a)
        h2d = nbytes / timed(a, h)
        del a, b, h
        torch.cuda.empty_cache()
        return d2d, h2d
    except Exception:  # a probe must never stop setup: no estimate then
        return None


def _disk_free(path: Path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 0


def _gpus() -> tuple[tuple[GPU, ...], tuple[str, ...]]:
    try:
        import torch
    except ImportError:
        return (), ("torch is not installed; budgeting against RAM.",)
    try:
        if not torch.cuda.is_available():
            return (), ()
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            out.append(GPU(i, props.name, int(total), int(free), (props.major, props.minor)))
        return tuple(out), ()
    except Exception as exc:  # a broken driver must not stop setup: fall back to CPU and say why
        return (), (f"CUDA is present but unusable ({exc}); budgeting against RAM.",)


def detect(strata_home: Path, *, cpu_only: bool = False) -> Hardware:
    """Probe the machine. `cpu_only` ignores GPUs (STRATA_DEVICE=cpu does the same)."""
    if cpu_only or os.environ.get("STRATA_DEVICE", "").lower() == "cpu":
        gpus, notes = (), ("GPU use is turned off; budgeting against RAM.",)
    else:
        gpus, notes = _gpus()
    total, avail = ram_bytes()
    return Hardware(
        gpus=gpus,
        ram_total_bytes=total,
        ram_available_bytes=avail,
        disk_free_bytes=_disk_free(strata_home),
        cpu_count=os.cpu_count() or 1,
        cpu_name=cpu_name(),
        notes=notes,
    )
