"""Refuse to run artifacts that changed after strata-setup verified them (docs/store.md, "Trust").

The config records, per target file and for a converted drafter, the sha256, size and modification time seen at
setup. Every run checks presence and size (cheap); a file whose modification time differs from the recorded one is
hashed again before it is trusted (so an in-place edit of the same size is caught without hashing multi-GB files
on every start). A config without recorded times falls back to hashing the files it lists.

An artifact that lives in the store carries the store's manifest beside it. When `strata-setup models verify` found
it damaged, the manifest says so (`verify_failed`), and the run stops here with the command that repairs it. When
the store re-fetched a file since setup (same sha256, new time), the manifest's recorded time is trusted as well, so
a repaired store does not cost a hash on every start.

Exit codes: a changed file (size or sha256) or a failed mark is a checksum failure, 1; a missing file is a config
that names nothing, 2.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from runtime.config import StrataConfig
from runtime.drafters.registry import KINDS
from runtime.errors import CorruptArtifactError, StaleArtifactError
from runtime.fileio import sha256_file

MANIFEST = ".strata-manifest.json"   # the store's per-item manifest (docs/store.md, "Manifests")


def store_manifest(folder: Path) -> dict[str, Any] | None:
    """The store manifest of an item folder, or None when there is none (a local folder) or it is unreadable."""
    p = Path(folder) / MANIFEST
    try:
        if not stat.S_ISREG(p.lstat().st_mode):
            return None
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _repair_hint(cfg: StrataConfig, what: str) -> str:
    t = cfg.target
    if what == "DFlash2 drafter":
        return "rerun strata-setup with the same choices to rebuild it"
    if t.source in ("hf", "bundled") and t.name:
        return f"repair it with `strata-setup models pull {t.name}`"
    return f"rerun strata-setup --target {cfg.resolve(t.path)} to check the folder again and rewrite the config"


def _check_mark(folder: Path, cfg: StrataConfig, what: str, file: str | None = None) -> dict[str, Any] | None:
    m = store_manifest(folder)
    if m is None or (file is not None and m.get("file") not in (None, file)):
        return None
    if m.get("verify_failed") or m.get("verified") is False:
        why = m.get("verify_failed") or "it is marked unverified"
        raise CorruptArtifactError(f"the {what} in {folder} failed `strata-setup models verify` ({why}); "
                                   f"{_repair_hint(cfg, what)}.")
    return m


def _check_file(path: Path, size: int | None, sha256: str | None, mtime_ns: int | None, what: str,
                hint: str, also_trusted: int | None = None) -> None:
    if not path.is_file():
        raise StaleArtifactError(f"the {what} {path} is missing; {hint}.")
    st = path.stat()
    if size is not None and size >= 0 and st.st_size != size:
        raise CorruptArtifactError(f"the {what} {path} changed size since strata-setup verified it "
                                   f"({st.st_size} bytes, expected {size}); {hint}.")
    if st.st_mtime_ns in {t for t in (mtime_ns, also_trusted) if t is not None}:
        return
    if sha256 and sha256_file(path) != sha256:
        raise CorruptArtifactError(f"the {what} {path} changed since strata-setup verified it (sha256 differs); "
                                   f"{hint}.")


def _manifest_time(m: dict[str, Any] | None, rel: str, sha256: str | None) -> int | None:
    """The store's recorded time of `rel`, when the store verified the same bytes the config recorded."""
    if not m or not m.get("verified") or not sha256:
        return None
    files = m.get("files") or {}
    if m.get("kind") == "converted":
        ok = m.get("sha256") == sha256 and m.get("file") == rel
        t = m.get("mtime_ns")
    else:
        ok = (files.get(rel) or {}).get("sha256") == sha256
        t = (m.get("mtime_ns") or {}).get(rel) if isinstance(m.get("mtime_ns"), dict) else None
    return int(t) if ok and isinstance(t, int) else None


def check_config_artifacts(cfg: StrataConfig) -> None:
    """Raise when a file the config lists is missing (StaleArtifactError), changed or marked failed by
    `models verify` (CorruptArtifactError)."""
    root = cfg.resolve(cfg.target.path)
    if root.suffix.lower() == ".gguf":
        root = root.parent            # a GGUF target's files (it and its MTP file) are named relative to its folder
    m = _check_mark(root, cfg, "target")
    hint = _repair_hint(cfg, "target file")
    for rel, rec in cfg.target.files.items():
        _check_file(root / rel, rec.size, rec.sha256, rec.mtime_ns, "target file", hint,
                    _manifest_time(m, rel, rec.sha256))
    d = cfg.drafter
    if KINDS[d.kind].needs_file and d.path:
        dpath = cfg.resolve(d.path)
        if dpath.is_dir():      # an HF-folder drafter: the loader validates its files; no single-file pin to check
            _check_mark(dpath, cfg, "DFlash2 drafter")
            return
        dm = _check_mark(dpath.parent, cfg, "DFlash2 drafter", dpath.name)
        if d.size is not None or d.sha256:
            _check_file(dpath, d.size, d.sha256, d.mtime_ns, "DFlash2 drafter",
                        _repair_hint(cfg, "DFlash2 drafter"), _manifest_time(dm, dpath.name, d.sha256))
