"""The local store under STRATA_HOME: downloads by (repo, revision), converted artifacts by (source sha256, quant,
converter version), each with a small JSON manifest. An item exists for the product only when its manifest says
`verified: true`; files are written under temporary names and renamed after their check, and the manifest is
written last (atomically), so an interrupted run never leaves something that looks complete.

Layout:
    $STRATA_HOME/downloads/<org>--<name>/<revision>/<files...>   + .strata-manifest.json
    $STRATA_HOME/downloads/bundled--<folder>/<revision or sha-...>/  (bundled packs, copied through the same checks)
    $STRATA_HOME/converted/<source sha256[:16]>-<quant>-c<converter version>/model.gguf + .strata-manifest.json
        (a converted target with an MTP head also holds mtp.gguf, listed in the manifest's `extra_files`)
    $STRATA_HOME/configs/*.toml                                  (written by the wizard; scanned for "in use")
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import WorkError
from runtime.fileio import atomic_write_text, sha256_file  # noqa: F401  (re-exported)
from runtime.paths import strata_home

MANIFEST = ".strata-manifest.json"
PART_SUFFIX = ".part"


class StoreError(WorkError, OSError):
    """A store operation failed (disk, permissions, a corrupt manifest); one sentence saying what to do."""


def manifest_sha256(files: Mapping[str, Mapping[str, Any]]) -> str:
    """One hash for a folder artifact: sha256 of the sorted lines `path<TAB>sha256<TAB>size`. The config records
    it as the target's `sha256`, so the calibration key changes when any of the target's files does."""
    lines = "".join(f"{p}\t{files[p]['sha256']}\t{int(files[p]['size'])}\n" for p in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def repo_key(repo: str) -> str:
    return repo.replace("/", "--")


@dataclass(frozen=True)
class StoreItem:
    """One manifest-bearing folder in the store."""

    path: Path
    manifest: dict[str, Any]

    @property
    def kind(self) -> str:          # "download" | "converted"
        return str(self.manifest.get("kind", "?"))

    @property
    def verified(self) -> bool:
        return bool(self.manifest.get("verified"))

    @property
    def size(self) -> int:
        extra = self.manifest.get("extra_files") or {}
        return int(self.manifest.get("size", 0)) + sum(int(f.get("size", 0)) for f in extra.values())

    @property
    def name(self) -> str:
        m = self.manifest
        if self.kind == "converted":
            return m.get("name") or f"{m.get('source_name') or str(m.get('source_sha256', ''))[:12]}:{m.get('quant')}"
        return str(m.get("name") or m.get("repo") or self.path.name)

    @property
    def artifact_path(self) -> Path:
        """The path a config records: the GGUF file for converted items, the folder for downloads."""
        if self.kind == "converted":
            return self.path / str(self.manifest.get("file", "model.gguf"))
        return self.path


class Store:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else strata_home()

    # -- places ---------------------------------------------------------------------------------------------------
    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def converted(self) -> Path:
        return self.root / "converted"

    @property
    def configs(self) -> Path:
        return self.root / "configs"

    def download_dir(self, repo: str, revision: str, source: str = "hf") -> Path:
        prefix = "bundled--" if source == "bundled" else ""
        return self.downloads / f"{prefix}{repo_key(repo)}" / revision

    def converted_dir(self, source_sha256: str, quant: str, converter_version: str) -> Path:
        return self.converted / f"{source_sha256[:16]}-{quant}-c{converter_version}"

    # -- manifests ------------------------------------------------------------------------------------------------
    @staticmethod
    def read_manifest(folder: Path) -> dict[str, Any] | None:
        p = Path(folder) / MANIFEST
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"verified": False, "corrupt": True}
        return doc if isinstance(doc, dict) else {"verified": False, "corrupt": True}

    @staticmethod
    def write_manifest(folder: Path, doc: Mapping[str, Any]) -> None:
        atomic_write_text(Path(folder) / MANIFEST, json.dumps(dict(doc), indent=2, sort_keys=True) + "\n")

    @staticmethod
    def invalidate(folder: Path) -> None:
        """Mark an item unverified (its files failed a check), so nothing uses it until it is rebuilt."""
        (Path(folder) / MANIFEST).unlink(missing_ok=True)

    def items(self) -> Iterator[StoreItem]:
        for base in (self.downloads, self.converted):
            if not base.is_dir():
                continue
            for m in sorted(base.rglob(MANIFEST)):
                doc = self.read_manifest(m.parent) or {}
                yield StoreItem(m.parent, doc)

    # -- verification ---------------------------------------------------------------------------------------------
    @staticmethod
    def verify_files(folder: Path, files: Mapping[str, Mapping[str, Any]], *, rehash: bool = True) -> list[str]:
        """Problems (one sentence each) with the files of an item: missing, wrong size, wrong sha256."""
        problems = []
        for rel, want in files.items():
            p = Path(folder) / rel
            if not p.is_file():
                problems.append(f"{rel} is missing")
                continue
            size = p.stat().st_size
            if size != int(want["size"]):
                problems.append(f"{rel} has {size} bytes, expected {want['size']}")
                continue
            if rehash:
                got = sha256_file(p)
                if got != want["sha256"]:
                    problems.append(f"{rel} has sha256 {got}, expected {want['sha256']}")
        return problems

    def verify_item(self, item: StoreItem) -> list[str]:
        m = item.manifest
        if m.get("corrupt"):
            return ["its manifest is unreadable"]
        if item.kind == "converted":
            f = str(m.get("file", "model.gguf"))
            files = {f: {"sha256": m.get("sha256", ""), "size": m.get("size", -1)}}
            files.update(m.get("extra_files") or {})   # a converted target's MTP file (docs/store.md)
            return self.verify_files(item.path, files)
        return self.verify_files(item.path, m.get("files", {}))

    # -- removal --------------------------------------------------------------------------------------------------
    def remove(self, item: StoreItem) -> None:
        root = self.root.resolve()
        p = item.path.resolve()
        if root not in p.parents:
            raise StoreError(f"Refusing to remove {item.path}: it is outside the store {self.root}.")
        shutil.rmtree(p)
        # drop now-empty parents (the repo folder of a download)
        parent = p.parent
        while parent != root and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    # -- configs --------------------------------------------------------------------------------------------------
    def config_paths(self) -> list[Path]:
        return sorted(self.configs.glob("*.toml")) if self.configs.is_dir() else []

    def references(self) -> dict[Path, list[Path]]:
        """Config file -> artifact paths it references ([target].path, [drafter].path, [drafter].source_path)."""
        out: dict[Path, list[Path]] = {}
        for cfg in self.config_paths():
            try:
                doc = tomllib.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
                continue
            refs = []
            for table, key in (("target", "path"), ("drafter", "path"), ("drafter", "source_path")):
                v = doc.get(table, {}).get(key) if isinstance(doc.get(table), dict) else None
                if isinstance(v, str) and v:
                    p = Path(v).expanduser()
                    refs.append(p if p.is_absolute() else (cfg.parent / p))
            out[cfg] = refs
        return out

    def used_by(self, item: StoreItem, refs: Mapping[Path, list[Path]] | None = None) -> list[Path]:
        """Configs that reference this item (its folder or any file inside it)."""
        refs = self.references() if refs is None else refs
        mine = item.path.resolve()
        users = []
        for cfg, paths in refs.items():
            for p in paths:
                try:
                    rp = p.resolve()
                except OSError:
                    continue
                if rp == mine or mine in rp.parents:
                    users.append(cfg)
                    break
        return users

    def leftovers(self) -> list[Path]:
        """Partial downloads and temp files (safe to delete when nothing runs), and folders without a manifest."""
        out: list[Path] = []
        for base in (self.downloads, self.converted):
            if not base.is_dir():
                continue
            for p in base.rglob("*"):
                if p.is_file() and (p.name.endswith(PART_SUFFIX) or p.name.endswith(".tmp")):
                    out.append(p)
        return sorted(out)

    def free_bytes(self, where: Path | None = None) -> int:
        p = Path(where or self.root)
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free


def check_disk_space(store: Store, needed: int, where: Path, what: str) -> None:
    """Refuse to start a write of `needed` bytes that cannot fit (with 1% + 16 MiB to spare)."""
    free = store.free_bytes(where)
    margin = needed // 100 + (16 << 20)
    if needed + margin > free:
        raise StoreError(f"Not enough disk space for {what}: {needed / 2**20:.1f} MiB needed, "
                         f"{free / 2**20:.1f} MiB free under {where}; free some space (strata-setup models gc) "
                         f"or set STRATA_HOME to a larger disk.")
