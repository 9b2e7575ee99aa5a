"""What this host is: CPU model name, RAM, and how many CPU threads are worth using. One place, so the wizard's
hardware summary and the calibration key name a CPU device with the same words, and strata-run, strata-setup and
calibration choose torch's thread count the same way."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def cpu_name() -> str:
    """"cpu: <model name>" from /proc/cpuinfo (else the platform's processor string)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


def cpu_flags() -> str:
    """The CPU's feature flags from /proc/cpuinfo, sorted and space-separated (else the platform's processor
    string): what code compiled for this machine may use."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    return " ".join(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def ram_bytes() -> tuple[int, int]:
    """(total, available) RAM in bytes from /proc/meminfo, falling back to sysconf; (0, 0) when unknown."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024
        total = fields["MemTotal"]
        return total, fields.get("MemAvailable", fields.get("MemFree", total))
    except (OSError, KeyError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0, 0


# ----------------------------------------------------------------------------------------------- CPU threads

def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and `taskset` narrow), not the
    machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average (runnable threads, machine-wide), or None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def idle_cpus(usable: int | None = None, load: float | None = None, total: int | None = None) -> int:
    """Usable CPUs not already busy: the load average's share of this process's CPUs taken away, at least 1.
    OpenMP threads on busy CPUs wait for each other at every parallel region, so a thread too many is worse
    than a thread too few."""
    usable = usable_cpus() if usable is None else usable
    load = load_average() if load is None else load
    total = max(usable, (os.cpu_count() or usable) if total is None else total)
    return max(1, min(usable, int(usable - load * usable / total + 0.5)))


@dataclass
class ThreadChoice:
    """How many torch threads to use here, and what that was based on (for the summary and the record)."""

    threads: int
    usable: int
    idle: int
    load: float | None
    probe_s: dict[int, float] = field(default_factory=dict)   # threads -> seconds of the probe (best repeat)
    reason: str = ""

    def to_dict(self) -> dict:
        return {"threads": self.threads, "usable": self.usable, "idle": self.idle, "load": self.load,
                "probe_s": {str(k): round(v, 6) for k, v in self.probe_s.items()}, "reason": self.reason}


def thread_candidates(idle: int) -> list[int]:
    """1, 2, 4, ... up to `idle`, and `idle` itself."""
    out, n = [], 1
    while n < idle:
        out.append(n)
        n *= 2
    return sorted({*out, idle})


def _probe(rows: int, width: int, inner: int, ops: int, repeats: int, limit_s: float,
           clock: Callable[[], float], give_up_s: float = float("inf")) -> float:
    """Best of `repeats` timings of `ops` small matmul + norm steps shaped like one decode step's work. A repeat
    that passes `give_up_s` (it cannot win any more) ends the probe with the time so far: on busy cores one
    step can take 1000x longer than on a free one, and the probe must stay short anyway."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g)
    w1 = torch.randn(width, inner, generator=g) / width ** 0.5
    w2 = torch.randn(inner, width, generator=g) / inner ** 0.5
    best = float("inf")
    spent = 0.0
    with torch.no_grad():
        for _ in range(repeats):
            t = clock()
            y = x
            for _ in range(ops):
                y = torch.nn.functional.silu(y @ w1) @ w2
                y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
                if clock() - t > give_up_s:
                    return clock() - t
            dt = clock() - t
            best, spent = min(best, dt), spent + dt
            if spent > limit_s:
                break
    return best


def choose_threads(*, hidden: int = 256, inner: int = 1024, rows: int = 4, ops: int = 12, repeats: int = 3,
                   limit_s: float = 0.25, margin: float = 0.1, usable: int | None = None, load: float | None = None,
                   probe: Callable[[int], float] | None = None) -> ThreadChoice:
    """Measure rather than trust `os.cpu_count()`: time a short probe shaped like the model's decode work
    (`hidden`, `inner`) at 1, 2, 4, ... threads up to the idle usable CPUs and take the fastest, preferring fewer
    threads unless more are faster by `margin`. The probe costs well under a second (each count stops after
    `limit_s`). `probe(threads) -> seconds` replaces the timing (tests). torch's thread count is left as found."""
    import torch

    usable = usable_cpus() if usable is None else usable
    load = load_average() if load is None else load
    idle = idle_cpus(usable, 0.0 if load is None else load)
    cands = thread_candidates(idle)
    if len(cands) == 1:
        why = "one usable CPU" if usable == 1 else f"{usable} usable CPUs, load {load:.1f}: one is free"
        return ThreadChoice(1, usable, idle, load, {}, why)
    before = torch.get_num_threads()
    times: dict[int, float] = {}
    try:
        for n in cands:
            if probe is not None:
                times[n] = float(probe(n))
                continue
            torch.set_num_threads(n)
            bound = min(times.values()) * (1 + margin) if times else float("inf")
            times[n] = _probe(rows, hidden, inner, ops, repeats, limit_s, time.perf_counter, give_up_s=bound)
    finally:
        torch.set_num_threads(before)
    best = min(times, key=lambda n: (times[n], n))
    pick = min(n for n in times if times[n] <= times[best] * (1 + margin))   # fewer threads unless clearly slower
    where = f"{usable} usable CPUs" + (f", load {load:.1f}" if load is not None else "")
    why = f"fastest of {', '.join(str(n) for n in cands)} threads in a short probe ({where})"
    return ThreadChoice(pick, usable, idle, load, times, why)
