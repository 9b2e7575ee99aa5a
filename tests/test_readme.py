"""Every shell command in README.md that works offline runs as written, in README order, and exits 0.

From a checkout (the bundled pack's folder is where the README's relative paths expect it), in a fresh
`$STRATA_HOME`, with the installed `strata-setup`/`strata-run`. Left out: creating venvs and `pip install` (they
need the network; CI runs exactly those steps before the suite) and `python -m pytest` (this suite). Every other
command of every ```bash block runs, including each part of a `&&` chain after the install steps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = (re.compile(r"^python3? -m venv\b"), re.compile(r"^\. \.venv/bin/activate$"), re.compile(r"^pip install\b"),
        re.compile(r"^python3? -m pytest\b"))


def readme_commands(text: str) -> list[str]:
    """The commands of the README's bash blocks, install and test-suite steps dropped (see the module docstring)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split(" && ")]
            keep = [p for p in parts if not any(rx.match(p) for rx in SKIP)]
            if keep:
                out.append(" && ".join(keep))
    return out


def test_the_parser_keeps_every_strata_command():
    cmds = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert cmds[0].startswith("strata-setup --yes") and "strata-run --config strata-nano.toml" in cmds[0]
    assert all(c.split()[0] in ("strata-setup", "strata-run", "printf", "echo") for c in cmds), cmds
    assert sum(1 for c in cmds if "strata-setup" in c) >= 10


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    bindir = Path(sys.executable).parent
    for tool in ("strata-setup", "strata-run"):
        assert (bindir / tool).exists(), f"{tool} is not installed next to {sys.executable}; run pip install -e ."
    work = tmp_path / "checkout"
    (work / "setup_wizard").mkdir(parents=True)
    (work / "setup_wizard" / "bundled").symlink_to(ROOT / "setup_wizard" / "bundled")
    env = dict(os.environ, STRATA_HOME=str(tmp_path / "home"), PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
               HF_HUB_OFFLINE="1", COLUMNS="120")
    env.pop("STRATA_CATALOG", None)
    outputs = {}
    for cmd in readme_commands((ROOT / "README.md").read_text(encoding="utf-8")):
        r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=280)
        assert r.returncode == 0, f"README command failed ({r.returncode}): {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        outputs[cmd] = r
    first = next(r for c, r in outputs.items() if c.startswith("strata-setup --yes --calibrate-seconds"))
    assert first.stdout.endswith("\n") and len(first.stdout.strip()) > 0            # strata-run wrote text
    assert (work / "strata-nano.toml").is_file() and (work / "head.gguf").is_file()
    budget = next(r for c, r in outputs.items() if c.startswith("strata-setup budget"))
    assert json.loads(budget.stdout)["fits"]
    configs = sorted(p.name for p in (tmp_path / "home" / "configs").glob("*.toml"))
    assert "strata-nano-dflash2-q4_0.toml" in configs and "strata-nano-none.toml" in configs
    assert not list(work.glob("*.bak")) and not list((tmp_path / "home" / "configs").glob("*.bak"))
