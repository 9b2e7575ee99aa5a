"""The strata-setup config (TOML, `schema = 1`): build, write atomically, merge user keys, load, check staleness.

Tables (docs/INTERFACES.md): `[target]`, `[drafter]`, `[speculative]`, `[memory]` + `[memory.budget]`, `[device]`,
`[calibration]` (+ `key`, `results`). `strata-run` ignores keys it does not know, and a rerun of strata-setup keeps
keys a user added (anything outside the keys below).
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from runtime.config import SCHEMA, parse, read_toml, tomlable  # noqa: F401  (SCHEMA: the one schema version)
from runtime.drafters.registry import KINDS
from runtime.errors import ConfigError, WorkError
from setup_wizard.store import manifest_sha256, sha256_file  # noqa: F401  (re-exported: one formula)

# The keys strata-setup writes, per table. A key not listed here is the user's and survives a rerun; a table
# marked None is replaced as a whole (its contents are all ours).
OWNED: dict[str, set[str] | None] = {
    "": {"schema", "created_by", "target", "drafter", "speculative", "memory", "device", "calibration"},
    "target": {"name", "path", "sha256", "source", "revision", "files", "has_mtp", "quantization", "source_sha256",
               "source_path"},
    "target.files": None,
    "drafter": {"kind", "head", "path", "sha256", "size", "quantization", "source_sha256", "source_path"},
    "speculative": {"block", "spec_min_p", "source", "block_source", "spec_min_p_source", "draft_temp_scale"},
    "memory": {"context", "kv_dtype", "dtype", "reserve_mib", "prefill_chunk", "expert_cache_slots", "total_experts",
               "expert_bytes", "budget", "fits"},
    "memory.budget": None,
    "device": {"type", "name", "total_mib", "free_mib", "capability", "dtype"},
    "calibration": None,  # the calibration area's record (calibrate.api), replaced as a whole
}


class ConfigWriteError(WorkError, OSError):
    """The config could not be written (disk full, permissions); the old file, if any, is intact (exit code 1)."""


def merge_user_keys(old: Mapping[str, Any], new: Mapping[str, Any], _table: str = "") -> dict[str, Any]:
    """`new` with every key of `old` that strata-setup does not own carried over (recursively)."""
    out = copy.deepcopy(dict(new))
    owned = OWNED.get(_table, set())
    if owned is None:
        return out
    for key, value in old.items():
        sub = f"{_table}.{key}" if _table else key
        if key not in owned:
            out.setdefault(key, copy.deepcopy(value))
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_user_keys(value, out[key], sub)
    return out


def backup_path(path: Path) -> Path:
    """Where the one backup of the config at `path` lives: `$STRATA_HOME/backups/` (docs/store.md), never beside
    the config. Configs in `$STRATA_HOME/configs` keep their name; others get a short hash of their full path."""
    from runtime.paths import configs_dir, strata_home

    path = Path(path).expanduser().resolve()
    name = path.name
    if path.parent != configs_dir().expanduser().resolve():
        name = f"{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}{path.suffix}"
    return strata_home() / "backups" / name


def write_config(path: Path, doc: Mapping[str, Any], *, keep_user_keys: bool = True) -> Path:
    """Atomic write: temp file in the same folder, fsync, re-parse to verify, rename. An interruption at any
    point leaves either the old config or the new one, never half of one. The replaced file is kept as the one
    backup of this config in the store (`backup_path`), nothing is left beside it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigWriteError(f"Cannot create the folder for the config {path} ({exc.strerror or exc}); pass "
                               f"--config-out elsewhere.") from exc
    doc = tomlable(doc)
    parse(doc, where=str(path))   # never write what strata-run would refuse
    if keep_user_keys and path.exists():
        try:
            old = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            old = {}
        doc = merge_user_keys(old, doc)
    text = tomli_w.dumps(doc)
    if tomllib.loads(text) != doc:  # pragma: no cover - tomli_w round-trips what it accepts
        raise ConfigError("The config did not survive a TOML round trip; this is a bug, please report it.")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ConfigWriteError(f"Cannot write the config {path} ({exc.strerror or exc}); check that folder's "
                               f"permissions and free space, or pass --config-out elsewhere.") from exc
    tmp_bak: str | None = None
    try:
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists() and path.read_bytes() != text.encode("utf-8"):
            bak = backup_path(path)
            bak.parent.mkdir(parents=True, exist_ok=True)
            fd2, tmp_bak = tempfile.mkstemp(prefix=f".{bak.name}.", suffix=".tmp", dir=bak.parent)
            os.close(fd2)
            shutil.copyfile(path, tmp_bak)
            os.replace(tmp_bak, bak)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        for t in (tmp, tmp_bak):
            if t:
                Path(t).unlink(missing_ok=True)
        raise ConfigWriteError(f"Cannot write the config {path} ({exc.strerror or exc}); check that folder's "
                               f"permissions and free space, or pass --config-out elsewhere.") from exc
    except BaseException:
        for t in (tmp, tmp_bak):
            if t:
                Path(t).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_config(path: Path) -> dict[str, Any]:
    """Read a config and check it with the one schema strata-run uses (runtime/config.py), requiring the tables
    setup always writes; paths in the returned document are resolved against the config's folder, as strata-run
    resolves them. ConfigError (one sentence) when it cannot be used."""
    path = Path(path)
    doc = read_toml(path)
    cfg = parse(doc, where=str(path), base=path.expanduser().parent, complete=True)
    doc["target"]["path"] = str(cfg.resolve(cfg.target.path))
    for key in ("path", "source_path"):
        if doc["drafter"].get(key):
            doc["drafter"][key] = str(cfg.resolve(doc["drafter"][key]))
    return doc


def stale_reasons(doc: Mapping[str, Any], *, deep: bool = False) -> list[str]:
    """Why the artifacts a config names can no longer be trusted: missing, size changed, or (with `deep`) sha256
    changed. Empty when everything is where the config says. Sizes are cheap; hashing multi-GB files is not."""
    from runtime.artifact_check import store_manifest

    reasons: list[str] = []
    target = doc.get("target", {})
    tpath = Path(target.get("path", ""))
    for folder, what in ((tpath, "target"), (Path((doc.get("drafter") or {}).get("path") or "").parent, "drafter")):
        mark = store_manifest(folder) if str(folder) not in ("", ".") else None
        if mark and mark.get("verify_failed"):
            reasons.append(f"the {what} in {folder} failed `strata-setup models verify` ({mark['verify_failed']})")
    if not tpath.exists():
        reasons.append(f"the target folder {tpath} is missing")
    else:
        for rel, meta in (target.get("files") or {}).items():
            f = tpath / rel
            if not f.is_file():
                reasons.append(f"the target file {f} is missing")
            elif f.stat().st_size != int(meta.get("size", -1)):
                reasons.append(f"the target file {f} changed size")
            elif deep and sha256_file(f) != meta.get("sha256"):
                reasons.append(f"the target file {f} changed (sha256 differs)")
    drafter = doc.get("drafter", {})
    if KINDS[drafter.get("kind", "none")].needs_file:
        dpath = Path(drafter.get("path", ""))
        if not dpath.is_file():
            reasons.append(f"the DFlash2 drafter {dpath} is missing")
        elif "size" in drafter and dpath.stat().st_size != int(drafter["size"]):
            reasons.append(f"the DFlash2 drafter {dpath} changed size")
        elif deep and drafter.get("sha256") and sha256_file(dpath) != drafter["sha256"]:
            reasons.append(f"the DFlash2 drafter {dpath} changed (sha256 differs)")
    return reasons


def calibration_key(
    *,
    device_name: str,
    device_total_mib: int,
    target_sha256: str,
    drafter_kind: str,
    drafter_sha256: str,
    quantization: str,
    context: int,
    runtime_version: str,
) -> dict[str, Any]:
    """docs/calibration.md: a stored calibration is reused only when every field matches."""
    return {
        "device_name": device_name,
        "device_total_mib": int(device_total_mib),
        "target_sha256": target_sha256,
        "drafter_kind": drafter_kind,
        "drafter_sha256": drafter_sha256,
        "quantization": quantization,
        "context": int(context),
        "runtime_version": runtime_version,
    }
