"""The installed commands start, print help and agree on the version."""

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

import runtime
import setup_wizard

ROOT = Path(__file__).resolve().parents[1]


def test_package_version_is_single_sourced():
    assert version("strata-setup") == runtime.__version__ == setup_wizard.__version__
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in meta["project"]["dynamic"]


@pytest.mark.parametrize("command", ["strata-setup", "strata-run", "strata-serve"])
def test_entry_point_help(command):
    exe = Path(sys.executable).parent / command
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout


@pytest.mark.parametrize("command", ["strata-setup", "strata-run", "strata-serve"])
def test_entry_point_version(command):
    exe = Path(sys.executable).parent / command
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{command} {runtime.__version__}"
