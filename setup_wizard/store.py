"""The local store under STRATA_HOME: downloads by (repo, revision), converted artifacts by (source sha256, quant,
converter version), each with a small JSON manifest. An item exists for the product only when its manifest says
`verified: true`; files are written under temporary names and renamed after their check, and the manifest is
written last (atomically), so an interrupted run never leaves something that looks complete.

Every write below the root goes through `store_fs` (no link is ever followed), every writer holds the item's lock
(`store_locks`), and the configs that use the store are known through `registry` (docs/store.md).

Layout:
    $STRATA_HOME/downloads/<org>--<name>/<revision>/<files...>   + .strata-manifest.json
    $STRATA_HOME/downloads/bundled--<folder>/<revision or sha-...>/  (bundled packs, copied through the same checks)
    $STRATA_HOME/converted/<source sha256[:16]>-<quant>-c<converter version>/model.gguf + .strata-manifest.json
        (a converted target with an MTP head also holds mtp.gguf, listed in the manifest's `extra_files`)
    $STRATA_HOME/configs/*.toml                                  (the default place of configs)
    $STRATA_HOME/config-registry.json                            (every config strata-setup wrote, wherever)
    $STRATA_HOME/locks/*.lock                                    (filelock files)
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.artifact_check import MANIFEST
from runtime.fileio import atomic_write_text, sha256_file  # noqa: F401  (re-exported)
from runtime.paths import strata_home
from setup_wizard.registry import ConfigRefs, live_configs
from setup_wizard.store_fs import (  # noqa: F401  (StoreError and friends re-exported)
    LinkRefused,
    StoreError,
    StoreNotWritable,
    open_dir,
    regular_file_problem,
    relative_inside,
)

PART_SUFFIX = ".part"
TMP_SUFFIX = ".tmp"


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
    """One item folder in the store (with its manifest; `{}` for a partial folder that has none)."""

    path: Path
    manifest: dict[str, Any]
    area: str = ""                  # "downloads" | "converted" (from where the folder is)

    @property
    def kind(self) -> str:          # "download" | "converted"
        k = self.manifest.get("kind")
        if k:
            return str(k)
        return {"downloads": "download", "converted": "converted"}.get(self.area, "?")

    @property
    def partial(self) -> bool:
        """A folder an interrupted run left without a manifest: never used, collected by gc."""
        return not self.manifest

    @property
    def verified(self) -> bool:
        return bool(self.manifest.get("verified"))

    @property
    def size(self) -> int:
        if self.partial:
            return _tree_size(self.path)
        extra = self.manifest.get("extra_files") or {}
        return int(self.manifest.get("size", 0)) + sum(int(f.get("size", 0)) for f in extra.values())

    @property
    def name(self) -> str:
        m = self.manifest
        if self.partial:
            return f"(partial) {self.area}/{'/'.join(self.path.parts[-2:] if self.area == 'downloads' else self.path.parts[-1:])}"
        if self.kind == "converted":
            return m.get("name") or f"{m.get('source_name') or str(m.get('source_sha256', ''))[:12]}:{m.get('quant')}"
        return str(m.get("name") or m.get("repo") or self.path.name)

    @property
    def artifact_path(self) -> Path:
        """The path a config records: the GGUF file for converted items, the folder for downloads."""
        if self.kind == "converted" and not self.partial:
            return self.path / str(self.manifest.get("file", "model.gguf"))
        return self.path


def _tree_size(path: Path) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                n += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return n


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
    def read_manifest(self, folder: Path) -> dict[str, Any] | None:
        p = Path(folder) / MANIFEST
        if regular_file_problem(self.root, p) is not None:
            return None if not os.path.lexists(p) else {"verified": False, "corrupt": True}
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"verified": False, "corrupt": True}
        return doc if isinstance(doc, dict) else {"verified": False, "corrupt": True}

    def write_manifest(self, folder: Path, doc: Mapping[str, Any]) -> None:
        """Atomically, inside the folder reached without links; the caller holds the item's lock."""
        folder = Path(folder)
        with open_dir(self.root, folder) as dfd:
            atomic_write_text(folder / MANIFEST, json.dumps(dict(doc), indent=2, sort_keys=True) + "\n",
                              dir_fd=dfd)

    def invalidate(self, folder: Path) -> None:
        """Mark an item unverified (its files failed a check, or it is being rebuilt), so nothing uses it."""
        try:
            with open_dir(self.root, Path(folder), create=False) as dfd:
                os.unlink(MANIFEST, dir_fd=dfd)
        except FileNotFoundError:
            pass

    def item_dirs(self) -> tuple[list[StoreItem], list[Path]]:
        """(every item folder, with or without a manifest; stray files and links where folders belong). Nothing
        below the root is followed through a link."""
        items: list[StoreItem] = []
        strays: list[Path] = []
        for base, depth in ((self.downloads, 2), (self.converted, 1)):
            try:
                st = os.lstat(base)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                strays.append(base)
                continue
            self._scan(base, depth, base.name, items, strays)
        return items, strays

    def _scan(self, folder: Path, depth: int, area: str, items: list[StoreItem], strays: list[Path]) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            p = Path(entry.path)
            if not entry.is_dir(follow_symlinks=False):
                strays.append(p)
            elif depth == 1:
                items.append(StoreItem(p, self.read_manifest(p) or {}, area))
            else:
                self._scan(p, depth - 1, area, items, strays)

    def items(self) -> Iterator[StoreItem]:
        """The items that have a manifest (verified, failed or corrupt)."""
        for it in self.item_dirs()[0]:
            if not it.partial:
                yield it

    # -- verification ---------------------------------------------------------------------------------------------
    def verify_files(self, folder: Path, files: Mapping[str, Mapping[str, Any]], *,
                     rehash: bool = True) -> list[str]:
        """Problems (one sentence each) with the files of an item: missing, a link or not a regular file inside the
        store, wrong size, wrong sha256."""
        problems = []
        for rel, want in files.items():
            p = Path(folder) / rel
            bad = regular_file_problem(self.root, p)
            if bad is not None:
                problems.append(bad.replace(relative_inside(self.root, p).as_posix(), rel, 1))
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
    def remove(self, item: StoreItem | Path) -> None:
        """Remove an item folder (or a stray file or link) of the store; links are removed, never followed."""
        p = Path(item.path if isinstance(item, StoreItem) else item)
        rel = relative_inside(self.root, p)
        if not rel.parts or rel.parts[0] not in ("downloads", "converted"):
            raise StoreError(f"Refusing to remove {p}: it is not an item of the store {self.root}.")
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(p)          # fd-based on Linux: links inside are removed, not followed
        else:
            p.unlink()
        parent = p.parent             # drop now-empty parents (the repo folder of a download)
        while parent.name not in ("downloads", "converted", "") and parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    # -- configs --------------------------------------------------------------------------------------------------
    def references(self, *, prune: bool = True) -> dict[Path, ConfigRefs]:
        """Every live config (the registry's and `configs/*.toml`) with what it names."""
        return live_configs(self.root, prune=prune)

    def used_by(self, item: StoreItem, refs: Mapping[Path, ConfigRefs] | None = None) -> list[Path]:
        """Live configs that use this item (its folder or any file inside it)."""
        refs = self.references() if refs is None else refs
        return [cfg for cfg, r in refs.items() if r.names(item.path)]

    def leftovers(self, item: StoreItem) -> list[Path]:
        """Partial downloads and temporary files inside an item folder (only safe to delete under its lock)."""
        out = []
        for dirpath, _dirs, files in os.walk(item.path):
            for f in files:
                if f.endswith((PART_SUFFIX, TMP_SUFFIX)):
                    out.append(Path(dirpath) / f)
        return sorted(out)

    def free_bytes(self, where: Path | None = None) -> int:
        p = Path(where or self.root)
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free


def disk_margin(needed: int) -> int:
    """Room kept free beyond a write: 1% of it plus 16 MiB (file-system overhead, other programs)."""
    return needed // 100 + (16 << 20)


def check_disk_space(store: Store, needed: int, where: Path, what: str) -> None:
    """Refuse to start a write of `needed` bytes that cannot fit with the safety margin to spare."""
    free = store.free_bytes(where)
    margin = disk_margin(needed)
    if needed + margin > free:
        raise StoreError(f"Not enough disk space for {what}: {needed / 2**20:.1f} MiB needed plus a "
                         f"{margin / 2**20:.1f} MiB safety margin (1% + 16 MiB), {free / 2**20:.1f} MiB free under "
                         f"{where}; free some space (strata-setup models gc) or set STRATA_HOME to a larger disk.")
