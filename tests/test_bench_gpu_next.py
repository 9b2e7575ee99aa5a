"""bench/gpu_next.sh, the GPU measurements a session without a device leaves for the next lease: every arm its
calls name is one of bench/step_ab.py's (a call that names a dropped arm would fail on the device, after its start
was paid for; so is every tile of runtime/gpu/moe_split.py it times), and every arm's chunk layout is one the
kernels take (runtime/kv.py `tiers4`, `one_row_layout`)."""

import re
from pathlib import Path

from bench.step_ab import ARMS
from runtime.gpu.moe_split import TILES
from runtime.kv import one_row_layout, tiers4

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_next.sh"


def _names(flag: str) -> list[str]:
    """The comma-separated names after each `flag`, quotes and shell expansions (`${best:+,$best}`) left out."""
    out = []
    for m in re.finditer(flag + r" (\S+)", SCRIPT.read_text()):
        out += [a for a in re.sub(r"\$\{[^}]*\}", "", m.group(1).strip('"')).split(",") if a]
    return out


def test_the_arms_the_script_names_exist():
    named = _names("--arms")
    assert len(named) >= 10 and "o-aware64" in named
    assert [a for a in named if a not in ARMS] == []
    # every tile of the split experts the script times alone is one moe_split has, and each has its step arm
    tiles = _names("--only")
    assert len(tiles) >= 4 and all(t.startswith("ffn-") for t in tiles), tiles
    assert [t for t in tiles if t[4:] not in TILES or t not in ARMS] == []


def test_every_arms_chunk_layout_is_accepted():
    for name, arm in ARMS.items():
        if "tiers" in arm:
            assert len(tiers4(arm["tiers"])) == 7, name
        for key in ("one_row_chunks", "one_row_chunks_q8"):     # runtime/kv.py ONE_ROW_CHUNKS(_Q8): None or valid
            if arm.get(key) is not None:
                assert one_row_layout(arm[key]) == tuple(arm[key]), name
    assert ARMS["one-row-tiers"]["one_row_chunks"] is None and "q8ad128" in _names("--arms")
