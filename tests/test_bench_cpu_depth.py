"""bench/cpu_depth.py runs on the bundled pack and writes its rows (a smoke run: one round, one step)."""

import json

import pytest
import torch

from bench import cpu_depth


def test_deeper_repeats_the_layers_as_copies_numbered_by_place():
    layers = [torch.nn.Module() for _ in range(3)]
    for m in layers:
        m.mlp = torch.nn.Module()
        m.mlp.w = torch.nn.Parameter(torch.randn(2))
    out = cpu_depth.deeper(layers, 7)
    assert [m.mlp.layer_idx for m in out] == list(range(7))
    assert all(out[i] is layers[i] for i in range(3))
    assert all(out[i] is not layers[i % 3] and torch.equal(out[i].mlp.w, layers[i % 3].mlp.w) for i in range(3, 7))


def test_cpu_depth_writes_its_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    res = cpu_depth.main(["--depths", "6,7", "--rounds", "1", "--steps", "1", "--block", "3"])
    got = json.loads((tmp_path / "cpu_depth.json").read_text())
    assert got["rows"] == json.loads(json.dumps(res["rows"]))
    assert [r["depth"] for r in got["rows"]] == [6, 7]
    tau, d = got["tokens_per_window"], got["draft_ms_per_window"]
    assert 1.0 <= tau <= 3.0 and d > 0          # block 3: at most two drafts accepted a window, plus the target's
    for r in got["rows"]:
        assert r["step_ms"] > 0 and r["verify_ms"] > 0
        assert r["speedup"] == pytest.approx(tau * r["step_ms"] / (d + r["verify_ms"]))
        assert r["speedup_free_drafter"] == pytest.approx(tau * r["step_ms"] / r["verify_ms"])
