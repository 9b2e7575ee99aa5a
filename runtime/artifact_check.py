"""Refuse to run artifacts that changed after strata-setup verified them.

The config records, per target file and for a converted drafter, the sha256, size and modification time seen at
setup. Every run checks presence and size (cheap); a file whose modification time differs from the recorded one is
hashed again before it is trusted (so an in-place edit of the same size is caught without hashing multi-GB files
on every start). A config without recorded times falls back to hashing the files it lists.
"""

from __future__ import annotations

from pathlib import Path

from runtime.config import StrataConfig
from runtime.errors import ChecksumMismatchError, StaleArtifactError
from runtime.fileio import sha256_file


def _check_file(path: Path, size: int | None, sha256: str | None, mtime_ns: int | None, what: str) -> None:
    if not path.is_file():
        raise StaleArtifactError(f"the {what} {path} is missing; rerun strata-setup to fetch it again.")
    st = path.stat()
    if size is not None and size >= 0 and st.st_size != size:
        raise ChecksumMismatchError(f"the {what} {path} changed size since strata-setup verified it "
                                 f"({st.st_size} bytes, expected {size}); rerun strata-setup.")
    if mtime_ns is not None and mtime_ns == st.st_mtime_ns:
        return
    if sha256 and sha256_file(path) != sha256:
        raise ChecksumMismatchError(f"the {what} {path} changed since strata-setup verified it (sha256 differs); "
                                 f"rerun strata-setup to fetch it again.")


def check_config_artifacts(cfg: StrataConfig) -> None:
    """Raise StaleArtifactError when a file the config lists is missing (exit 2), ChecksumMismatchError when it
    changed (exit 1)."""
    root = cfg.resolve(cfg.target.path)
    for rel, rec in cfg.target.files.items():
        _check_file(root / rel, rec.size, rec.sha256, rec.mtime_ns, "target file")
    d = cfg.drafter
    if d.kind == "dflash2" and d.path:
        dpath = cfg.resolve(d.path)
        if dpath.is_dir():      # an HF-folder drafter: the loader validates its files; no single-file pin to check
            return
        if d.size is not None or d.sha256:
            _check_file(dpath, d.size, d.sha256, d.mtime_ns, "DFlash2 drafter")
