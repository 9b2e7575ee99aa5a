"""The prefill's choice between the fused chunk and the module forward (runtime/gpu/prefill_chunk.py). The fused path
itself runs in the Triton interpreter (tests/runtime/kernels_check.py `check_prefill_chunk`, via test_static_step)."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu import prefill_chunk
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.speculative import prefill
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def model(tmp_path):
    return load_target(make_tiny_target(tmp_path, seed=4))


def _kv(model) -> KVCache:
    c = model.cfg
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32)


@pytest.fixture
def clean_errors():
    saved = list(prefill_chunk.ERRORS)
    prefill_chunk.ERRORS.clear()
    yield prefill_chunk.ERRORS
    prefill_chunk.ERRORS[:] = saved


def test_cpu_cache_takes_the_module_forward(model):
    assert not prefill_chunk.usable(model, _kv(model))


def test_a_kernel_that_fails_falls_back_once_and_is_remembered(model, monkeypatch, clean_errors):
    ids = [3, 9, 4, 17, 5, 8, 2]
    kv_ref = _kv(model)
    ref = prefill(model, kv_ref, ids, (), 4)
    calls = []

    def broken(m, kv, input_ids, taps, keep):
        calls.append(int(input_ids.shape[1]))
        kv.length += 2                     # a half-run chunk: the fallback must not trust the length it left
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(prefill_chunk, "usable", lambda m, kv: not prefill_chunk.ERRORS)
    monkeypatch.setattr(prefill_chunk, "forward", broken)
    kv = _kv(model)
    got = prefill(model, kv, ids, (), 4)
    assert calls == [4]                    # tried on the first chunk only, then the module forward from there on
    assert clean_errors and "PTX assembly failed" in clean_errors[0]
    assert kv.length == len(ids)
    assert torch.equal(got, ref)
    assert torch.equal(kv.k[:, :, :, :len(ids)], kv_ref.k[:, :, :, :len(ids)])


@pytest.mark.parametrize("exc", [torch.cuda.OutOfMemoryError("CUDA out of memory"), ValueError("too long")])
def test_the_requests_own_errors_are_not_hidden(model, monkeypatch, clean_errors, exc):
    def failing(m, kv, input_ids, taps, keep):
        raise exc

    monkeypatch.setattr(prefill_chunk, "usable", lambda m, kv: True)
    monkeypatch.setattr(prefill_chunk, "forward", failing)
    kv = _kv(model)
    with pytest.raises(type(exc)):
        prefill(model, kv, [1, 2, 3], (), 4)
    assert kv.length == 0 and not clean_errors     # nothing recorded: the fused path stays on
