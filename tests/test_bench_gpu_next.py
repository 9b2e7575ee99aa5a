"""bench/gpu_next.sh, the GPU measurements a session without a device leaves for the next lease: every arm its
calls name is one of bench/step_ab.py's (a call that names a dropped arm would fail on the device, after its start
was paid for), and every arm's chunk layout is one the kernels take (runtime/kv.py `tiers4`)."""

import re
from pathlib import Path

from bench.step_ab import ARMS
from runtime.kv import tiers4

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_next.sh"


def test_the_arms_the_script_names_exist():
    named = [a for m in re.finditer(r"--arms (\S+)", SCRIPT.read_text()) for a in m.group(1).split(",")]
    assert len(named) >= 10
    assert [a for a in named if a not in ARMS] == []


def test_every_arms_chunk_layout_is_accepted():
    for name, arm in ARMS.items():
        if "tiers" in arm:
            assert len(tiers4(arm["tiers"])) == 7, name
