"""What this host is: CPU model name and RAM. One place, so the wizard's hardware summary and the calibration key
name a CPU device with the same words."""

from __future__ import annotations

import os
import platform


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
