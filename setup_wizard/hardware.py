"""What this machine has: GPUs (through torch), RAM and free disk. A plain dataclass so tests can inject one."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device_type"] = self.device_type
        d["device_name"] = self.device_name
        return d


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
