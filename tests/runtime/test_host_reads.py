"""The speculative loop reads the device once per window (docs/models.md, "Speculative loop").

A host read of a device tensor (`.tolist()`, `.item()`, `int(t)`, `bool(t)`, `nonzero`, a tensor made from host
data, ...) stalls the host until the GPU has caught up, so on a GPU every read inside a window costs a pipeline
bubble. On the CPU the same code runs, so the reads are counted here by intercepting every torch call
(`TorchFunctionMode`). Not counted: the bodies that run as CUDA graphs on a GPU (a drafter's graph functions and
the fixed-width target step: a graph cannot hold a host read, and tests/runtime/drafters/dflash2/test_graphs.py
runs them on the meta device, where any read raises) and the CPU fallback of the routed experts (the GPU runs the
grouped kernel there). Counted: the loop, the acceptance, the drafters' host code and the step's host side.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from runtime import speculative
from runtime.drafters.dflash2.graphs import DFlash2Graphs
from runtime.drafters.dflash2.loading import load_dflash2_drafter
from runtime.drafters.mtp import MTPDrafter
from runtime.gpu.capture import GraphSet
from runtime.gpu.static_step import StaticStep
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.models.layers import SparseMoe
from runtime.sampling import SamplingParams
from runtime.speculative import generate_ids
from tests.runtime.drafters.dflash2.helpers import drafter_config, write_hf_drafter
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
         "masked_select", "tensor", "as_tensor", "unique", "bincount"}


class ReadCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and name in READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


@pytest.fixture
def counter(monkeypatch):
    c = ReadCounter()

    def paused(orig):
        def wrapper(*a, **kw):
            with c.pause():
                return orig(*a, **kw)
        return wrapper

    monkeypatch.setattr(GraphSet, "_run", paused(GraphSet._run))          # graph replays on a GPU
    monkeypatch.setattr(StaticStep, "_step", paused(StaticStep._step))    # the captured target step
    monkeypatch.setattr(SparseMoe, "forward", paused(SparseMoe.forward))  # the grouped expert kernel on a GPU
    return c


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    folder = make_tiny_target(root, vocab=64, hidden=32, layers=3, seed=7, scale=2.0)
    model = load_target(folder)
    cfg = drafter_config(hidden=32, inter=64, vocab=64, heads=2, kv_heads=1, head_dim=16, taps=(0, 2),
                         num_target_layers=3, block_size=6, top_k=4, rank=16)
    return model, write_hf_drafter(root / "dflash2", cfg, seed=4)


PROMPT = [5, 6, 7, 8, 9, 10, 3, 12, 40]


def _run(model, counter, drafter=None, *, block=1, min_p=0.0, sampling=None, new=24):
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 96)
    step = StaticStep(model, kv, width=max(block, 1), graph=False)
    sp = sampling or SamplingParams()

    def go(n):
        counter.reads.clear()
        with counter:
            r = generate_ids(model, kv, PROMPT, drafter=drafter, block=block, spec_min_p=min_p, sampling=sp,
                             max_new_tokens=n, stop_ids=set(), step=step)
        return r, list(counter.reads)

    _, base = go(1)                         # prefill and the first token only: no window
    r, reads = go(new)
    assert r.stats["windows"] > 3 and len(r.token_ids) == new
    return r, len(reads) - len(base), reads


def _mtp(model, host_cut=False):
    d = MTPDrafter(model, 96, max_block=6)
    d.host_cut = host_cut                   # the GPU behaviour: the floor cut stays on the device
    return d


@pytest.mark.parametrize("ahead", [False, True])
def test_target_only_reads_once_per_token(setup, counter, monkeypatch, ahead):
    monkeypatch.setattr(speculative, "DECODE_AHEAD_CPU", ahead)    # the next step queued before the read (GPU)
    r, n, reads = _run(setup[0], counter)
    assert n == r.stats["windows"], reads
    assert (r.stats["decoded_ahead"] > 0) == ahead


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_greedy_mtp_reads_once_per_window(setup, counter, min_p):
    model = setup[0]
    r, n, reads = _run(model, counter, _mtp(model), block=4, min_p=min_p)
    assert n == r.stats["windows"], reads


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_greedy_dflash2_graph_path_reads_once_per_window(setup, counter, min_p):
    model, path = setup
    d = load_dflash2_drafter(path, model, context=96)
    d.host_cut = False
    d.graphs = DFlash2Graphs(d)             # on the CPU its functions run eagerly (what a GPU replays)
    r, n, reads = _run(model, counter, d, block=6, min_p=min_p)
    assert d.graphs.enabled and not d.graphs.errors
    assert n == r.stats["windows"], reads


@pytest.mark.parametrize("kind", ["mtp", "dflash2"])
@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_sampled_windows_read_once(setup, counter, kind, min_p):
    model, path = setup
    if kind == "mtp":
        d = _mtp(model)
    else:
        d = load_dflash2_drafter(path, model, context=96)
        d.host_cut = False
    sp = SamplingParams(temperature=0.8, seed=3)
    r, n, reads = _run(model, counter, d, block=4, min_p=min_p, sampling=sp)
    assert n == r.stats["windows"], reads


def test_counter_sees_a_read(setup, counter):
    """The instrument itself: a `.tolist()` and an `int()` inside the loop are counted."""
    x = torch.arange(3)
    with counter:
        x.tolist()
        int(x[0])
    assert counter.reads == ["tolist", "__int__"]
