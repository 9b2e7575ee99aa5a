"""The pieces under strata-serve: stop strings cut as OpenAI cuts them, the engine's cancel hook, and the worker's
queue bound."""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine import Engine
from runtime.sampling import SamplingParams
from runtime.serve_queue import Job, QueueFullError, ShuttingDownError, StopText, Worker
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _cut(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40), stops=st.lists(st.text(alphabet="abc\n", max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_text_emits_exactly_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    cut = StopText(stops)
    out = "".join(cut.push(p) for p in pieces) + cut.flush()
    assert out == _cut(text, stops)
    assert (cut.hit is not None) == any(s and s in text for s in stops)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_target(tmp_path_factory.mktemp("q"), seed=4, scale=2.0)
    eng = Engine.build(folder, drafter_kind="mtp", device="cpu", context=256, block=4)
    eng.stop_ids = set()
    return eng


def test_cancel_stops_between_windows_with_a_prefix_of_the_output(engine):
    full = engine.generate("hello", max_new_tokens=60)
    asked = []

    def cancel():
        asked.append(1)
        return len(asked) > 3

    part = engine.generate("hello", max_new_tokens=60, cancel=cancel)
    assert part.stats["stop_reason"] == "cancelled" and part.stats["windows"] == 3
    assert 0 < len(part.token_ids) < len(full.token_ids)
    assert part.token_ids == full.token_ids[: len(part.token_ids)]
    assert engine.generate("hello", max_new_tokens=60).token_ids == full.token_ids   # nothing left behind


def test_worker_bounds_its_queue_and_stops(engine):
    gate = threading.Event()
    done = []

    class Gated:
        def generate(self, *a, **kw):
            gate.wait(10)
            return engine.generate(*a, **kw)

    w = Worker(Gated(), max_queue=1)
    w.start()
    jobs = [Job([5, 6], 4, SamplingParams(), sink=lambda k, v: done.append((k, v))) for _ in range(3)]
    w.submit(jobs[0])
    w.submit(jobs[1])
    with pytest.raises(QueueFullError, match="queue is full \\(1 waiting"):
        w.submit(jobs[2])
    gate.set()
    assert w.stop(10) and not w.alive
    with pytest.raises(ShuttingDownError):
        w.submit(jobs[2])
    finished = [v.finish_reason for k, v in done if k == "done"]
    assert len(finished) == 2 and set(finished) <= {"length", "cancelled"}
