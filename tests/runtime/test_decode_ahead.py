"""Target-only decoding queues the next one-row step from the device token before reading this one
(docs/models.md, "Decoding ahead"): the tokens, the stop reason and the committed cache are those of queuing it
after the read, whatever ends the generation (length, a stop token, a cancel, the context)."""

from __future__ import annotations

import pytest
import torch

from runtime import speculative
from runtime.gpu.static_step import StaticStep
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.sampling import SamplingParams
from runtime.speculative import generate_ids
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 6, 7, 8, 9, 10, 3, 12, 40]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(make_tiny_target(tmp_path_factory.mktemp("ahead"), vocab=64, hidden=32, layers=3, seed=11,
                                        scale=2.0))


def _run(model, ahead: bool, monkeypatch, *, cap: int = 96, width: int = 1, **kw):
    """(result, committed length, committed K, committed V) with decoding ahead on or off, through a step of
    `width` rows (an engine configured for a drafter decodes alone through its block-wide step)."""
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap)
    step = StaticStep(model, kv, width=width, graph=False)
    monkeypatch.setattr(speculative, "DECODE_AHEAD", ahead)
    monkeypatch.setattr(speculative, "DECODE_AHEAD_CPU", True)       # the GPU's path, run eagerly
    r = generate_ids(model, kv, PROMPT, step=step, **kw)
    k, v = kv.committed()
    return r, kv.length, k.clone(), v.clone()


def _same(a, b) -> None:
    ra, la, ka, va = a
    rb, lb, kb, vb = b
    assert ra.token_ids == rb.token_ids
    assert ra.stop_reason == rb.stop_reason
    assert la == lb == len(PROMPT) + len(ra.token_ids) - 1     # every emitted token but the last was fed
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("sampled", [False, True])
def test_length_end_same_tokens_and_cache(model, monkeypatch, sampled, width):
    sp = SamplingParams(temperature=0.9, seed=5) if sampled else None
    on = _run(model, True, monkeypatch, max_new_tokens=20, sampling=sp, width=width)
    off = _run(model, False, monkeypatch, max_new_tokens=20, sampling=sp, width=width)
    _same(on, off)
    assert on[0].stop_reason == "length" and len(on[0].token_ids) == 20
    # every window but the last queued its successor; none with the switch off
    assert on[0].stats["decoded_ahead"] == on[0].stats["windows"] - 1 == 18
    assert off[0].stats["decoded_ahead"] == 0


def test_stop_token_discards_the_window_queued_ahead(model, monkeypatch):
    ref = _run(model, False, monkeypatch, max_new_tokens=20)[0].token_ids
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])     # a token first seen mid-generation
    on = _run(model, True, monkeypatch, max_new_tokens=20, stop_ids={ref[j]})
    off = _run(model, False, monkeypatch, max_new_tokens=20, stop_ids={ref[j]})
    _same(on, off)
    assert on[0].stop_reason == "stop" and on[0].token_ids == ref[: j + 1]
    assert on[0].stats["decoded_ahead"] == j           # the window after the stop token was queued, then dropped


def test_cancel_discards_the_window_queued_ahead(model, monkeypatch):
    def run(ahead):
        seen: list[int] = []
        return _run(model, ahead, monkeypatch, max_new_tokens=20, on_tokens=seen.extend,
                    should_stop=lambda: len(seen) >= 7)
    on, off = run(True), run(False)
    _same(on, off)
    assert on[0].stop_reason == "cancelled" and len(on[0].token_ids) == 7


def test_off_on_a_cpu_unless_asked(model, monkeypatch):
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 96)
    r = generate_ids(model, kv, PROMPT, step=StaticStep(model, kv, width=1, graph=False), max_new_tokens=6)
    assert r.stats["decoded_ahead"] == 0 and len(r.token_ids) == 6


def test_context_end(model, monkeypatch):
    cap = len(PROMPT) + 6                # room for 6 fed tokens: the window at the last slot is never queued ahead
    on = _run(model, True, monkeypatch, cap=cap, max_new_tokens=20)
    off = _run(model, False, monkeypatch, cap=cap, max_new_tokens=20)
    _same(on, off)
    assert on[0].stop_reason == "context" and len(on[0].token_ids) == 7
