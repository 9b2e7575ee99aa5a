"""Where the local store lives (docs/store.md): `$STRATA_HOME`, else the platformdirs user data dir for `strata`.
The one definition every part (setup, store, calibration, strata-run by name) reads. Configs by name:
`strata-run NAME` / `strata-serve NAME` mean `$STRATA_HOME/configs/NAME.toml`, the file strata-setup wrote
(docs/commands.md)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from runtime.errors import UsageError

__all__ = ["ConfigNameError", "compiled_dir", "config_by_name", "config_names", "configs_dir", "looks_like_name", "resolve_config",
           "strata_home"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ConfigNameError(UsageError):
    """A config name that names no config (bad input: one clear sentence, exit 2)."""


def strata_home() -> Path:
    """$STRATA_HOME, else the platformdirs user data dir for `strata`."""
    env = os.environ.get("STRATA_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("strata"))


def configs_dir() -> Path:
    return strata_home() / "configs"


def compiled_dir() -> Path:
    """Code compiled for this machine: the target's CPU step (runtime/target_compiled.py) and the MTP drafter's
    (runtime/drafters/mtp_compiled.py)."""
    return strata_home() / "compiled"


def config_names() -> list[str]:
    """Names of the configs strata-setup wrote, sorted."""
    d = configs_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.toml") if p.is_file() and _NAME.match(p.stem))


def config_by_name(name: str) -> Path:
    """`$STRATA_HOME/configs/<name>.toml`; an unknown name is one sentence that lists the known ones."""
    if _NAME.match(name) and (p := configs_dir() / f"{name}.toml").is_file():
        return p
    names = config_names()
    known = f"known names: {', '.join(names)}" if names else "none is set up yet; run strata-setup first"
    raise ConfigNameError(f"no config named {name!r} in {configs_dir()} ({known}); or pass --config PATH.")


def looks_like_name(value: str) -> bool:
    """A bare word (no folder, no .toml suffix) is a config name rather than a path."""
    return bool(_NAME.match(value)) and not value.endswith(".toml") and os.sep not in value and "/" not in value


def resolve_config(value: str) -> Path:
    """A config given as a path or as a name: an existing file wins, then a bare word is looked up by name."""
    p = Path(value).expanduser()
    if p.is_file() or not looks_like_name(value):
        return p
    return config_by_name(value)
