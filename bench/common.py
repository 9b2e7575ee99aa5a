"""Shared pieces of the GPU benchmarks: where results go, what machine ran them, a rich table, the copy bandwidth,
the calibration prompts, and a wall-clock budget so one device call ends in time."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NANO = ROOT / "setup_wizard" / "bundled" / "strata-nano"
NANO_DFLASH2 = ROOT / "setup_wizard" / "bundled" / "strata-nano-dflash2"
PROMPTS = ROOT / "calibrate" / "prompts"


def out_dir() -> Path:
    """$OUT when set (the device machine), else bench/results/."""
    d = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    d.mkdir(parents=True, exist_ok=True)
    return d


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform(), "cpu": platform.processor() or platform.machine()}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_mib=p.total_memory >> 20, sms=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    return info


def write_json(name: str, data: dict[str, Any]) -> Path:
    path = out_dir() / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in (columns[0],) else "left")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    Console(width=160).print(t)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / median(times)


def task_prompts() -> dict[str, str]:
    """The four calibration task prompts (code, long, math, prose)."""
    return {p.stem: p.read_text() for p in sorted(PROMPTS.glob("*.txt"))}


class Deadline:
    """A wall-clock budget: `left()` seconds remain; `over()` once spent."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0
