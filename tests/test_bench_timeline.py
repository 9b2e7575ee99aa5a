"""bench/step_timeline.py's arithmetic on a made-up trace: the layer's kernels found by their repeating names, and
each kernel's lead, run and what it adds to the step computed from start and end times as the docstring says."""

import json

import pytest

from bench.step_timeline import kernel_events, layer_period, timeline

LAYER = ["qkv", "post", "split", "reduce", "o_proj", "router", "route", "gate_up", "down_sum"]


def fake_steps(steps: int, layers: int) -> list[dict]:
    """Kernels of `steps` steps: an embedding, `layers` layers of LAYER, a head. Kernel j of a layer starts j / 10 us
    before the previous kernel ends (PDL) and runs 1 + j us; each step starts 50 us after the last one ended."""
    out, t = [], 0.0
    for _ in range(steps):
        out.append({"name": "embed", "start": t, "end": t + 3.0, "grid": [1, 1, 1], "regs": 16})
        t += 3.0
        for _ in range(layers):
            for j, n in enumerate(LAYER):
                s = t - j / 10
                out.append({"name": n, "start": s, "end": s + 1 + j, "grid": [j + 1, 1, 1], "regs": 32})
                t = s + 1 + j
        out.append({"name": "head", "start": t, "end": t + 7.0, "grid": [1, 1, 1], "regs": 64})
        t += 7.0 + 50.0
    return out


def test_the_layer_pattern_and_each_kernels_lead_run_and_share():
    r = timeline(fake_steps(3, 8), 3, 8)
    assert (r["kernels_per_step"], r["kernels_per_layer"], r["first_layer_at"]) == (74, 9, 1)
    assert [x["kernel"] for x in r["rows"]] == LAYER
    for j, x in enumerate(r["rows"]):
        assert x["lead"] == pytest.approx(-j / 10) and x["dur"] == pytest.approx(1 + j)
        assert x["adds"] == pytest.approx(1 + j - j / 10) and x["grid"] == [j + 1, 1, 1]
    assert r["layer_adds_us"] == pytest.approx(sum(1 + j - j / 10 for j in range(9)))
    assert r["profiled_step_us"] == pytest.approx(3 + 8 * r["layer_adds_us"] + 7)
    assert [k["kernel"] for k in r["outside_layers"]] == ["embed", "head"]


def test_a_trace_that_does_not_split_into_steps_is_refused():
    with pytest.raises(SystemExit, match="not a whole number"):
        timeline(fake_steps(2, 8)[:-1], 2, 8)
    with pytest.raises(SystemExit, match="repeats 9 times"):
        layer_period(["a", "b", "c"] * 8, 9)


def test_kernel_events_reads_the_chrome_trace_kernels_in_start_order(tmp_path):
    ev = [{"ph": "X", "cat": "kernel", "name": "b", "ts": 5.0, "dur": 2.0,
           "args": {"grid": [4, 1, 1], "registers per thread": 40}},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 9.0},
          {"ph": "X", "cat": "kernel", "name": "a", "ts": 1.5, "dur": 1.0, "args": {}}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    ks = kernel_events(str(p))
    assert [(k["name"], k["start"], k["end"], k["regs"]) for k in ks] == [("a", 1.5, 2.5, None), ("b", 5.0, 7.0, 40)]
