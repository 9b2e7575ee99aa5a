"""Shared fixtures for the DFlash2 tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster, and immune to OpenMP spin-wait collapse on a busy machine
    (measured: the e2e module took 5 minutes with 2 threads under load, 15 s with one). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
