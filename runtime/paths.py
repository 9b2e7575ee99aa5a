"""Where the local store lives (docs/store.md): `$STRATA_HOME`, else the platformdirs user data dir for `strata`.
The one definition every part (setup, store, calibration, strata-run by name) reads."""

from __future__ import annotations

import os
from pathlib import Path


def strata_home() -> Path:
    env = os.environ.get("STRATA_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("strata"))
