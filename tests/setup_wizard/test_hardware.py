"""Hardware detection: CPU-only mode, a (simulated) GPU through torch, and a broken driver falling back to RAM."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from runtime.hostinfo import ram_bytes
from setup_wizard.hardware import detect


def test_cpu_only_mode_budgets_against_ram(tmp_path):
    hw = detect(tmp_path / "not-yet-created" / "home", cpu_only=True)
    assert hw.device_type == "cpu" and hw.runtime_dtype == "fp32"
    assert hw.total_bytes == hw.ram_total_bytes > 0 and 0 < hw.free_bytes <= hw.total_bytes
    assert hw.disk_free_bytes > 0  # measured on the nearest existing parent
    assert hw.device_name.startswith("cpu: ") and "CPU only" in hw.describe()
    assert any("turned off" in n for n in hw.notes)


def test_gpu_through_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (100 << 30, 140 << 30))
    hw = detect(tmp_path)
    assert hw.device_type == "cuda" and hw.runtime_dtype == "bf16"
    assert hw.device_name == "NVIDIA H200" and hw.total_bytes == 140 << 30 and hw.free_bytes == 100 << 30
    assert hw.gpus[0].capability == (9, 0) and "sm_90" in hw.describe()
    assert hw.to_dict()["device_type"] == "cuda"


def test_broken_cuda_falls_back_to_cpu_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def boom(i):
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)
    hw = detect(tmp_path)
    assert hw.device_type == "cpu" and "driver too old" in hw.notes[0]


def test_meminfo_fallback(monkeypatch):
    real_open = open

    def no_proc(path, *a, **k):
        if str(path) == "/proc/meminfo":
            raise OSError("no procfs")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", no_proc)
    total, avail = ram_bytes()
    assert total > 0 and 0 < avail <= total
