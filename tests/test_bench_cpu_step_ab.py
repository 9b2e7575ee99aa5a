"""bench/cpu_step_ab.py runs on the bundled pack and writes its rows (a smoke run: one round, one step)."""

import json

from bench import cpu_step_ab


def test_cpu_step_ab_writes_its_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    res = cpu_step_ab.main(["--tasks", "code", "--widths", "1,2", "--switches", "fewer_ops,shared_keys",
                            "--rounds", "1", "--steps", "1", "--prefix", "40"])
    rows = json.loads((tmp_path / "cpu_step_ab.json").read_text())["rows"]
    assert rows == json.loads(json.dumps(res["rows"]))
    assert [(r["width"], r["switch"]) for r in rows] == [(1, "fewer_ops"), (2, "fewer_ops")]   # nothing to share
    assert all(r["context"] == 40 and r["off_ms"] > 0 and r["on_ms"] > 0 for r in rows)
    from runtime.gpu import static_step

    assert static_step.CPU_FEWER_OPS is True          # the switch is put back
    import torch

    assert torch.is_grad_enabled()                    # and autograd is left as it was
