"""Refuse to run artifacts that changed after strata-setup verified them.

The config records, per target file and for a converted drafter, the sha256, size and modification time seen at
setup. Every run checks presence and size (cheap); a file whose modification time differs from the recorded one is
hashed again before it is trusted (so an in-place edit of the same size is caught without hashing multi-GB files
on every start). A config without recorded times falls back to hashing the files it lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtime.errors import StaleArtifactError
from runtime.fileio import sha256_file


def _check_file(path: Path, meta: Mapping[str, Any], what: str) -> None:
    if not path.is_file():
        raise StaleArtifactError(f"the {what} {path} is missing; rerun strata-setup to fetch it again.")
    st = path.stat()
    if "size" in meta and st.st_size != int(meta["size"]):
        raise StaleArtifactError(f"the {what} {path} changed size since strata-setup verified it "
                                 f"({st.st_size} bytes, expected {int(meta['size'])}); rerun strata-setup.")
    recorded = meta.get("mtime_ns")
    if recorded is not None and int(recorded) == st.st_mtime_ns:
        return
    want = meta.get("sha256")
    if want and sha256_file(path) != want:
        raise StaleArtifactError(f"the {what} {path} changed since strata-setup verified it (sha256 differs); "
                                 f"rerun strata-setup to fetch it again.")


def check_config_artifacts(doc: Mapping[str, Any], resolve: Callable[[str], Path]) -> None:
    """Raise StaleArtifactError when a file the config lists is missing or changed."""
    target = doc.get("target") or {}
    files = target.get("files") or {}
    if files and "path" in target:
        root = resolve(target["path"])
        for rel, meta in files.items():
            if isinstance(meta, Mapping):
                _check_file(root / rel, meta, "target file")
    drafter = doc.get("drafter") or {}
    if drafter.get("kind") == "dflash2" and drafter.get("path"):
        dpath = resolve(drafter["path"])
        if dpath.is_dir():      # an HF-folder drafter: the loader validates its files; no single-file pin to check
            return
        if "size" in drafter or "sha256" in drafter:
            _check_file(dpath, drafter, "DFlash2 drafter")
