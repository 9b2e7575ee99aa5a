"""bench/spec_scale.py end to end on the CPU with a toy tower (`--shape tiny`): the GPU run's code paths (the scaled
step, the drafters' windows, the A3B-width sweep, greedy and sampled arms, the goals, the JSON) run here first, so a
device call is not spent on a Python error. Figures from it mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "spec_scale.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--tasks", "code",
                           *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


@pytest.mark.slow
def test_check_mode_finds_every_arm_equal(tmp_path):
    r = _run(tmp_path, "--check", "--check-tokens", "4")
    assert r.returncode == 0 and "check: all equal" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "spec_scale_check.json").read_text())["check"]["rows"]
    assert any("tower step == pack step" in row[0] for row in rows) and any("MTP" in row[0] for row in rows)


@pytest.mark.slow
def test_bench_mode_writes_every_arm_and_the_width_sweep(tmp_path):
    r = _run(tmp_path, "--new-tokens", "5", "--repeats", "1", "--sampled-seeds", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "spec_scale.json").read_text())
    assert set(res["a3b"]["step_ms"]) == {str(w) for w in range(1, 17)}
    code = res["arms"]["MTP chain 3 (b4)"]["greedy"]["code"]
    assert {"tok_s", "speedup", "tokens_per_window", "draft_ms", "verify_ms"} <= set(code)
    assert code["equal_same_width"] is True
    assert "sampled" in res["arms"]["target-only"] and "bars" in res["goals"]
    hot = res["arms"]["MTP chain 3 (b4), drafts x1.5"]      # sampled only, over two seeds
    assert "greedy" not in hot and hot["draft_temp_scale"] == 1.5 and hot["sampled"]["code"]["tok_s"] > 0
