"""The store's registry of configs (docs/store.md, "The config registry"): every config `strata-setup` writes whose
artifacts live in the store is recorded in `$STRATA_HOME/config-registry.json`, wherever the config itself was
written (`--config-out`), so `models gc` and `models rm` keep what any live config uses. A scan prunes an entry
whose file is gone or no longer names anything in the store. Configs in `$STRATA_HOME/configs/` count too, recorded
or not.

Configs are read with the one schema (`runtime.config`); a config that no longer parses still protects every store
path written in it (its text is searched), so a half-edited file never lets `gc` remove its models.
"""

from __future__ import annotations

import errno
import json
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config import parse
from runtime.errors import ConfigError
from runtime.fileio import atomic_write_text
from setup_wizard.store_fs import open_dir, os_error_sentence, writing
from setup_wizard.store_locks import store_lock

REGISTRY = "config-registry.json"


@dataclass
class ConfigRefs:
    """What one config names: resolved artifact paths, or (when it cannot be parsed) its text to search."""

    path: Path
    refs: list[Path] = field(default_factory=list)
    text: str | None = None     # set when the config could not be parsed: every store path in it is protected

    def names(self, item: Path) -> bool:
        """Whether this config uses the store item folder `item` (the folder or any file inside it)."""
        mine = _resolve(item)
        for p in self.refs:
            if p == mine or mine in p.parents:
                return True
        if self.text is not None:
            return any(s in self.text for s in {str(item), str(mine)})
        return False


def _resolve(p: Path) -> Path:
    try:
        return Path(p).expanduser().resolve()
    except OSError:
        return Path(p).expanduser().absolute()


def read_refs(cfg: Path) -> ConfigRefs | None:
    """The artifact paths a config names ([target] path, [drafter] path and source_path), relative paths taken
    against the config's folder; None when the file is gone."""
    try:
        text = cfg.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return ConfigRefs(cfg, text="")
    try:
        c = parse(tomllib.loads(text), where=str(cfg), base=cfg.parent)
    except (tomllib.TOMLDecodeError, ConfigError):
        return ConfigRefs(cfg, text=text)
    paths = [c.target.path, c.drafter.path, c.drafter.source_path]
    return ConfigRefs(cfg, refs=[_resolve(c.resolve(p)) for p in paths if p])


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def points_into(refs: ConfigRefs, root: Path) -> bool:
    """Whether the config names anything under the store root (an unparsable config counts when its text does)."""
    r = _resolve(root)
    if refs.text is not None:
        return str(root) in refs.text or str(r) in refs.text
    return any(_inside(p, r) for p in refs.refs)


def _registry_file(root: Path) -> Path:
    return Path(root) / REGISTRY


def _read(root: Path) -> list[str]:
    try:
        doc = json.loads(_registry_file(root).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return []          # a damaged registry: the configs/ folder still counts; the next write repairs it
    paths = doc.get("configs") if isinstance(doc, Mapping) else None
    return [str(p) for p in paths if isinstance(p, str)] if isinstance(paths, list) else []


def _write(root: Path, paths: Iterable[str]) -> None:
    doc: dict[str, Any] = {"schema": 1, "configs": sorted(set(paths))}
    with open_dir(root, Path(root)) as dfd:
        atomic_write_text(_registry_file(root), json.dumps(doc, indent=2) + "\n", dir_fd=dfd)


def register_config(config: Path, root: Path) -> bool:
    """Record `config` in the registry of the store at `root` when it names something there; returns whether it
    was recorded. Idempotent."""
    path = Path(config).expanduser().absolute()
    refs = read_refs(path)
    if refs is None or not points_into(refs, root):
        return False
    try:
        with store_lock(root, "registry", what="the config registry"):
            have = _read(root)
            if str(path) not in have:
                _write(root, [*have, str(path)])
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return False    # a read-only store: nothing can remove what the config uses, so nothing to record
        better = os_error_sentence(exc, root, "the config registry", then="run strata-setup again")
        raise (better or exc) from None
    return True


def live_configs(root: Path, *, prune: bool = True) -> dict[Path, ConfigRefs]:
    """Every live config of the store: the registry's (pruned of files that are gone or no longer name the store)
    and the files in `configs/`."""
    root = Path(root)
    out: dict[Path, ConfigRefs] = {}
    folder = root / "configs"
    if folder.is_dir():
        for cfg in sorted(folder.glob("*.toml")):
            refs = read_refs(cfg)
            if refs is not None:
                out[cfg.absolute()] = refs
    registered = _read(root)
    keep = []
    for s in registered:
        cfg = Path(s)
        refs = read_refs(cfg)
        if refs is None or not points_into(refs, root):
            continue
        keep.append(s)
        out.setdefault(cfg, refs)
    if prune and len(keep) != len(registered):
        with writing(root, "the config registry"), store_lock(root, "registry", what="the config registry"):
            now = _read(root)   # entries registered since the scan above stay
            gone = set(registered) - set(keep)
            _write(root, [p for p in now if p not in gone])
    return out
