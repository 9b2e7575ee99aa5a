"""The key's device is the one the engine runs on for the config's [device] type ("auto" and "cuda:N" included)."""

from types import SimpleNamespace

import pytest
import torch

from calibrate.key import current_device
from runtime.hostinfo import cpu_name


@pytest.fixture
def fake_gpus(monkeypatch):
    names = ["GPU zero", "GPU one"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name=names[i], total_memory=(i + 1) * 2**30))

    def no_info(i):
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_info)
    return names


@pytest.mark.parametrize("dtype, want", [(None, ("GPU zero", 1024)), ("auto", ("GPU zero", 1024)),
                                         ("cuda", ("GPU zero", 1024)), ("cuda:1", ("GPU one", 2048)),
                                         ("CUDA", ("GPU zero", 1024))])
def test_cuda_settings_key_the_gpu(fake_gpus, dtype, want):
    assert current_device(dtype) == want


def test_cpu_setting_keys_the_cpu(fake_gpus):
    assert current_device("cpu")[0] == cpu_name()
