"""runtime/models/cpu_plan.py: a layer's weights gathered once give the cpu_rows.py path's bits (the CPU step's and
the MTP head's rows), follow every change of a weight, and RoPE from the table is RoPE made alone."""

import pytest
import torch

from runtime.cpu_layout import relayout
from runtime.drafters import mtp as mtp_mod
from runtime.drafters.mtp import MTPDrafter
from runtime.gpu import static_step
from runtime.gpu.static_step import StaticStep
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.models import cpu_plan, cpu_rows
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = torch.tensor([[5, 9, 11, 2, 7, 30]])
SEQ = [12, 40, 3, 8, 41, 4, 5, 9]


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """A tiny target held as a CPU engine holds it: experts packed, q/k/v stacked, weights input-major."""
    m = load_target(make_tiny_target(tmp_path_factory.mktemp("plan"), seed=5, scale=2.0))
    for layer in (*m.model.layers, *m.mtp.layers):
        assert layer.mlp.pack_dense(hot=layer in tuple(m.mtp.layers))
        layer.self_attn.stack_qkv()
    assert relayout(m) > 0
    return m


def _kv(m, cap=64):
    c = m.cfg
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap)


def _run(m, width, split, taps=(0, 2)):
    """Each window's logits, hidden rows, taps and recorded routing through a fresh step."""
    kv = _kv(m)
    rec = []
    for layer in m.model.layers:
        layer.mlp.recorder = lambda i, idx: rec.append((i, idx.clone()))
    try:
        with torch.no_grad():
            m(PROMPT, kv=kv)
            rec.clear()
            step = StaticStep(m, kv, width=width, graph=False)
            assert step.plan.get() is not None                      # every layer plannable
            out, i = [], 0
            for n in split:
                o = step(torch.tensor([SEQ[i:i + n]]), kv, taps)
                out.append((o.logits.clone(), o.hidden.clone(), o.taps.clone()))
                i += n
    finally:
        for layer in m.model.layers:
            layer.mlp.recorder = None
    k, v = kv.committed()
    return out, rec, (k.clone(), v.clone())


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("width,split", [(1, (1,) * 8), (3, (1, 3, 3, 1)), (4, (4, 2, 1, 1))])
def test_plan_step_gives_the_cpu_rows_bits(placed, width, split, shared, monkeypatch):
    """The step through the plans (static_step.CPU_PLAN) against the same step through cpu_rows.py: the same
    logits, hidden rows, taps, recorded routing and cache, bit for bit (the same ops on the same tensors).
    `shared`: rows from position 8 read the keys before their 4-position chunk with the window's other rows."""
    assert static_step.CPU_PLAN and static_step.CPU_FEWER_OPS
    if shared:
        monkeypatch.setattr(static_step, "CPU_SHARED_FROM", 8)
        monkeypatch.setattr(static_step, "CPU_SHARED_CHUNK", 4)
    on = _run(placed, width, split)
    monkeypatch.setattr(static_step, "CPU_PLAN", False)
    off = _run(placed, width, split)
    for a, b in zip(on[0], off[0], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert len(on[1]) == len(off[1]) == len(split) * len(placed.model.layers)
    assert all(i == j and torch.equal(x, y) for (i, x), (j, y) in zip(on[1], off[1], strict=True))
    assert torch.equal(on[2][0], off[2][0]) and torch.equal(on[2][1], off[2][1])


def test_plans_follow_weights_changed_repointed_or_replaced(placed):
    """A plan is made again after a weight changes in place, is re-pointed (`.data =`) or replaced by a new
    Parameter, and after a layer's experts move to an offload pool (then there is no plan)."""
    plan = cpu_plan.ModelPlan(placed.model.layers)
    layer = placed.model.layers[1]
    first = plan.get()
    assert first is not None and plan.get() is first                 # nothing changed: the same plans
    o = layer.self_attn.o_proj
    keep_o, keep_n = o.weight.data, layer.post_attention_layernorm.weight
    try:
        with torch.no_grad():
            o.weight.mul_(2)                                          # in place
        second = plan.get()
        assert second is not first and torch.equal(second[1].wo, o.weight.t())
        o.weight.data = keep_o.clone() * 3                            # re-pointed
        third = plan.get()
        assert third is not second and torch.equal(third[1].wo, o.weight.t())
        layer.post_attention_layernorm.weight = torch.nn.Parameter(keep_n.detach() + 1)   # replaced
        fourth = plan.get()
        assert fourth is not third
        assert torch.equal(fourth[1].ln2, cpu_rows.ln_weight(layer.post_attention_layernorm))
        layer.mlp.offload = lambda *a: None
        assert plan.get() is None
    finally:
        layer.mlp.offload = None
        with torch.no_grad():
            o.weight.data = keep_o
            o.weight.div_(2)
        layer.post_attention_layernorm.weight = keep_n
    assert plan.get() is not None


def test_rope_table_gives_each_position_its_own_matrices(placed):
    """Rows sliced from the table, inside a span and across its end, equal the matrices made for them alone."""
    table = cpu_plan.RopeTable(placed.rotary, span=8)
    for first, n in ((0, 1), (3, 4), (7, 3), (8, 8), (100, 2), (5, 12)):
        cos, sin = placed.rotary(torch.arange(first, first + n)[None], torch.float32)
        want = cpu_rows.rope_matrices(cos[0], sin[0])
        assert torch.equal(table.get(first, n, torch.float32, torch.device("cpu")), want), (first, n)


def test_mtp_rows_through_the_plan_give_the_cpu_rows_bits(placed, monkeypatch):
    """The MTP head's CPU rows (a window's committed rows, then a chain) through the layer's plan: the same bits
    as through cpu_rows.py."""
    g = torch.Generator().manual_seed(7)
    hid = torch.randn(8, placed.cfg.hidden_size, generator=g)
    toks = torch.tensor(SEQ)

    def rows() -> list[torch.Tensor]:
        d = MTPDrafter(placed, 32, max_block=4)
        with torch.no_grad():
            return [d._step(toks[:5], hid[:5], 1), d._step(toks[5:6], hid[5:6], 6), d._step(toks[6:7], hid[6:7], 7)]

    assert cpu_plan.ModelPlan(placed.mtp.layers).get() is not None
    on = rows()
    monkeypatch.setattr(mtp_mod, "_PLAN", False)
    off = rows()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
