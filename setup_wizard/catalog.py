"""The model catalog: `configs/catalog.toml` (shipped), then the user catalog `$STRATA_HOME/catalog.toml` (what
`strata-setup models add` pinned), then `STRATA_CATALOG` (a file named for one process: a test, a team's shared
pins); a later file's entry replaces an earlier one of the same name (docs/store.md, "Catalog").

Every entry is validated on load; a problem raises `CatalogError` naming the catalog file, the entry and the key.
An entry is *pinned* when it carries a full 40-hex `revision` and at least one `[[entry.file]]` with a 64-hex
`sha256` and a `size`; an entry with neither (no revision and no files) is *unpinned*: listed, never downloaded.
A half-pinned entry (a revision without files, files without a revision, a file without its hash) is an error:
a pin we do not fully know must not be guessed.

File paths and bundled folder names come from a file we do not control, so they are checked like untrusted input:
relative POSIX paths inside the repository, no `..`, no absolute paths, no backslashes, no empty components.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import UsageError
from runtime.formats.gguf_split import part_names

HEAD_KINDS = ("dflash2", "dflash")   # drafter heads: DFlash2, and DFlash v1 (no convolutions, no selector)
KINDS = ("target", *HEAD_KINDS)
USER_CATALOG = "catalog.toml"
SOURCES = ("hf", "bundled")
ENV_CATALOG = "STRATA_CATALOG"

_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_ENTRY_KEYS = {"name", "kind", "source", "repo", "revision", "fits", "default", "file", "description", "mtp",
               "license", "pinned", "quant"}
_QUANT = re.compile(r"[a-z0-9_]{2,16}")
_FILE_KEYS = {"path", "sha256", "size"}


class CatalogError(UsageError):
    """The catalog (shipped or STRATA_CATALOG) is malformed, or a name is not in it; one sentence (exit code 2)."""


def shipped_catalog_path() -> Path:
    import configs

    return Path(configs.__file__).resolve().parent / "catalog.toml"


def bundled_root() -> Path:
    """Where `source = "bundled"` folders live (shipped inside the package)."""
    return Path(__file__).resolve().parent / "bundled"


@dataclass(frozen=True)
class CatalogFile:
    path: str      # relative POSIX path inside the repository / bundled folder (checked)
    sha256: str
    size: int


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    kind: str                      # target | dflash2 | dflash (a v1 head, run by the dflash2 drafter)
    source: str                    # hf | bundled
    repo: str | None               # hf: "org/name"; bundled: folder name under setup_wizard/bundled
    revision: str | None           # full 40-hex commit (hf); None when unpinned
    files: tuple[CatalogFile, ...] = ()
    fits: tuple[str, ...] = ()     # heads: the target entries it drafts for
    default: bool = False          # heads: the head chosen when --dflash2-head is not given
    description: str = ""
    mtp: bool | None = None        # target: has an MTP head
    origin: str = ""               # which catalog file defined it
    quant: str | None = None       # a GGUF target: how its file stores the experts (e.g. "q4_k"), as models add read it

    @property
    def pinned(self) -> bool:
        """hf: a full revision and hashed files; bundled: hashed files (the folder ships with the package)."""
        return bool(self.files) and (self.revision is not None or self.source == "bundled")

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> CatalogFile:
        for f in self.files:
            if f.path == path:
                return f
        raise CatalogError(f"Catalog entry {self.name!r} has no file {path!r}.")

    def weights_files(self) -> list[CatalogFile]:
        return [f for f in self.files if f.path.endswith(".safetensors")]

    @property
    def gguf_file(self) -> str | None:
        """A GGUF target entry's file (a llama.cpp GGUF from the Hub, docs/store.md "Catalog"; the first part of a
        split one), else None."""
        paths = [f.path for f in self.files]
        one = bool(paths) and is_gguf_name(paths[0]) and part_names(paths[0]) == paths
        return paths[0] if self.kind == "target" and one else None

    @property
    def is_head(self) -> bool:
        return self.kind in HEAD_KINDS

    def unpinned_message(self) -> str:
        how = (f"pin it with `strata-setup models add {self.repo}`" if self.source == "hf" and self.repo
               else "add a pinned entry with `strata-setup models add REPO`")
        return (f"Catalog entry {self.name!r} is not pinned (no full revision and file hashes are known for it), so "
                f"it cannot be downloaded; {how}, or pass a local folder.")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "source": self.source, "repo": self.repo,
                "revision": self.revision, "pinned": self.pinned, "size": self.size, "fits": list(self.fits),
                "default": self.default, "description": self.description, "mtp": self.mtp,
                "files": [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files],
                "origin": self.origin, "quant": self.quant, "gguf_file": self.gguf_file}


@dataclass
class Catalog:
    entries: dict[str, CatalogEntry] = field(default_factory=dict)

    def __iter__(self):
        return iter(self.entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def get(self, name: str) -> CatalogEntry:
        try:
            return self.entries[name]
        except KeyError:
            known = ", ".join(sorted(self.entries)) or "none"
            raise CatalogError(f"{name!r} is not in the catalog (known: {known}).") from None

    def targets(self) -> list[CatalogEntry]:
        return [e for e in self if e.kind == "target"]

    def heads(self, target: str | None = None) -> list[CatalogEntry]:
        """Drafter heads (DFlash2 and DFlash v1), those that fit `target` when given (the default first)."""
        hs = [e for e in self if e.is_head and (target is None or target in e.fits)]
        return sorted(hs, key=lambda e: (not e.default, e.name))

    def default_head(self, target: str) -> CatalogEntry | None:
        for e in self.heads(target):
            if e.default:
                return e
        return None


# ---------------------------------------------------------------------------------------------------------------
# validation helpers

def is_gguf_name(path: str) -> bool:
    return path.lower().endswith(".gguf")

def check_relpath(path: Any, where: str) -> str:
    """A relative POSIX path that stays inside its root; raises CatalogError naming `where` otherwise."""
    if not isinstance(path, str) or not path:
        raise CatalogError(f"{where}: path must be a non-empty string.")
    if "\\" in path:
        raise CatalogError(f"{where}: path {path!r} contains a backslash; use forward slashes.")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise CatalogError(f"{where}: path {path!r} is absolute; catalog paths are relative to the repository.")
    if any(ord(c) < 32 for c in path):
        raise CatalogError(f"{where}: path {path!r} contains a control character.")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise CatalogError(f"{where}: path {path!r} escapes or is not a clean path inside the repository.")
    return path


def safe_join(root: Path, rel: str, where: str = "file") -> Path:
    """root / rel, refusing anything that would land outside root (also through symlinked parents)."""
    check_relpath(rel, where)
    root_r = Path(root).resolve()
    p = (root_r / rel).resolve()
    if p != root_r and root_r not in p.parents:
        raise CatalogError(f"{where}: path {rel!r} escapes {root}.")
    return root_r / rel


def _entry(raw: Any, origin: str, idx: int) -> CatalogEntry:
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{origin}: entry #{idx + 1} is not a table.")
    name = raw.get("name")
    label = f"{origin}: entry {name!r}" if isinstance(name, str) else f"{origin}: entry #{idx + 1}"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CatalogError(f"{label}: key 'name' must be a short name of letters, digits, '.', '_' or '-'.")
    unknown = set(raw) - _ENTRY_KEYS
    if unknown:
        raise CatalogError(f"{label}: unknown key(s) {', '.join(sorted(unknown))}.")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise CatalogError(f"{label}: key 'kind' is {kind!r}; use one of {', '.join(KINDS)}.")
    source = raw.get("source")
    if source not in SOURCES:
        raise CatalogError(f"{label}: key 'source' is {source!r}; use one of {', '.join(SOURCES)}.")
    repo = raw.get("repo")
    if repo is not None:
        if not isinstance(repo, str):
            raise CatalogError(f"{label}: key 'repo' must be a string.")
        if source == "hf" and not _REPO.fullmatch(repo):
            raise CatalogError(f"{label}: key 'repo' {repo!r} is not a Hub repository id like 'org/name'.")
        if source == "bundled":
            check_relpath(repo, f"{label}: key 'repo'")
            if "/" in repo:
                raise CatalogError(f"{label}: key 'repo' {repo!r} must be one folder name under the bundled folder.")
    revision = raw.get("revision")
    if revision is not None and (not isinstance(revision, str) or not _HEX40.fullmatch(revision)):
        raise CatalogError(f"{label}: key 'revision' must be a full 40-hex commit in lower case, got {revision!r}.")
    files_raw = raw.get("file", [])
    if not isinstance(files_raw, list):
        raise CatalogError(f"{label}: key 'file' must be an array of tables ([[entry.file]]).")
    files: list[CatalogFile] = []
    seen: set[str] = set()
    for j, fr in enumerate(files_raw):
        if not isinstance(fr, Mapping):
            raise CatalogError(f"{label}: file #{j + 1} is not a table.")
        fl = f"{label}: file #{j + 1}"
        unknown = set(fr) - _FILE_KEYS
        if unknown:
            raise CatalogError(f"{fl}: unknown key(s) {', '.join(sorted(unknown))}.")
        path = check_relpath(fr.get("path"), f"{fl} key 'path'")
        fl = f"{label}: file {path!r}"
        if path in seen:
            raise CatalogError(f"{fl}: listed twice.")
        seen.add(path)
        sha = fr.get("sha256")
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise CatalogError(f"{fl}: key 'sha256' must be 64 lower-case hex digits, got {sha!r}.")
        if "size" not in fr:
            raise CatalogError(f"{fl}: key 'size' is missing.")
        size = fr["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CatalogError(f"{fl}: key 'size' must be a non-negative integer, got {size!r}.")
        files.append(CatalogFile(path, sha, size))
    if source == "hf" and files and revision is None:
        raise CatalogError(f"{label}: key 'revision' is missing; files are pinned only at a full commit.")
    if revision is not None and not files:
        raise CatalogError(f"{label}: key 'file' is missing; a pinned entry lists every file it needs "
                           f"with sha256 and size.")
    if source == "bundled" and not files:
        raise CatalogError(f"{label}: a bundled entry must list its files with sha256 and size.")
    if (files or revision) and repo is None:
        raise CatalogError(f"{label}: key 'repo' is missing.")
    fits = raw.get("fits", [])
    default = raw.get("default", False)
    if kind in HEAD_KINDS:
        if not isinstance(fits, list) or not fits or not all(isinstance(f, str) for f in fits):
            raise CatalogError(f"{label}: key 'fits' must list the target entries this head drafts for.")
        if not isinstance(default, bool):
            raise CatalogError(f"{label}: key 'default' must be true or false.")
    else:
        if "fits" in raw or "default" in raw:
            bad = "fits" if "fits" in raw else "default"
            raise CatalogError(f"{label}: key {bad!r} is only for head entries ({', '.join(HEAD_KINDS)}).")
    mtp = raw.get("mtp")
    if mtp is not None and (kind != "target" or not isinstance(mtp, bool)):
        raise CatalogError(f"{label}: key 'mtp' is true/false and only for target entries.")
    ggufs = [f.path for f in files if is_gguf_name(f.path)]
    if ggufs and (kind != "target" or part_names(ggufs[0]) != [f.path for f in files] or "/" in ggufs[0]):
        raise CatalogError(f"{label}: a GGUF entry is a target that lists exactly one .gguf file at the top of its "
                           f"repository (the file holds the tokenizer too), or every part of one split file in "
                           f"order (NAME-00001-of-0000N.gguf first); got {', '.join(f.path for f in files)}.")
    if ggufs and mtp:
        raise CatalogError(f"{label}: key 'mtp' is true, but a GGUF file from the Hub carries no MTP head Strata "
                           f"reads; set it false.")
    quant = raw.get("quant")
    if quant is not None and (not ggufs or not isinstance(quant, str) or not _QUANT.fullmatch(quant)):
        raise CatalogError(f"{label}: key 'quant' names a GGUF target's storage (like \"q4_k\") and is only for an "
                           f"entry whose file is a .gguf.")
    pinned_flag = raw.get("pinned")
    is_pinned = bool(files) and (revision is not None or source == "bundled")
    if pinned_flag is not None and pinned_flag != is_pinned:
        raise CatalogError(f"{label}: key 'pinned' says {str(pinned_flag).lower()} but the entry "
                           f"{'has' if is_pinned else 'lacks'} a full pin (revision and file hashes).")
    desc = raw.get("description", "")
    if not isinstance(desc, str):
        raise CatalogError(f"{label}: key 'description' must be a string.")
    is_head = kind in HEAD_KINDS
    return CatalogEntry(name=name, kind=kind, source=source, repo=repo, revision=revision, files=tuple(files),
                        fits=tuple(fits) if is_head else (), default=bool(default) and is_head, description=desc,
                        mtp=mtp, origin=origin, quant=quant)


def _read(path: Path) -> list[CatalogEntry]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(f"Catalog file {path} does not exist; fix {ENV_CATALOG} or create the file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CatalogError(f"Catalog file {path} cannot be read ({exc}).") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"Catalog file {path} is not valid TOML ({exc}).") from None
    unknown = set(data) - {"entry", "schema"}
    if unknown:
        raise CatalogError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}; entries are [[entry]].")
    raw = data.get("entry", [])
    if not isinstance(raw, list):
        raise CatalogError(f"{path}: 'entry' must be an array of tables ([[entry]]).")
    out: list[CatalogEntry] = []
    names: set[str] = set()
    for i, r in enumerate(raw):
        e = _entry(r, str(path), i)
        if e.name in names:
            raise CatalogError(f"{path}: entry {e.name!r} is defined twice.")
        names.add(e.name)
        out.append(e)
    return out


def _cross_check(cat: Catalog) -> None:
    targets = {e.name for e in cat.targets()}
    for e in cat:
        if not e.is_head:
            continue
        for t in e.fits:
            if t not in targets:
                raise CatalogError(f"{e.origin}: entry {e.name!r}: key 'fits' names {t!r}, which is not a target "
                                   f"entry in the catalog.")
    for t in targets:
        defaults = [h.name for h in cat.heads(t) if h.default]
        if len(defaults) > 1:
            raise CatalogError(f"Catalog: target {t!r} has more than one default dflash2 head "
                               f"({', '.join(defaults)}); mark one with default = true.")


def user_catalog_path(env: Mapping[str, str] | None = None) -> Path:
    """`$STRATA_HOME/catalog.toml`: the entries `strata-setup models add` pinned."""
    env = os.environ if env is None else env
    if env.get("STRATA_HOME"):
        return Path(env["STRATA_HOME"]).expanduser() / USER_CATALOG
    from platformdirs import user_data_dir

    return Path(user_data_dir("strata")) / USER_CATALOG


def load_catalog(extra: Path | str | None = None, *, shipped: Path | None = None,
                 env: Mapping[str, str] | None = None, user: Path | None = None) -> Catalog:
    """The shipped catalog, then the user catalog (`user`, default `$STRATA_HOME/catalog.toml`, when it exists), then
    `extra` (default: $STRATA_CATALOG); each file's entries replace same-named ones of the files before it."""
    env = os.environ if env is None else env
    paths: list[Path] = [shipped or shipped_catalog_path()]
    user = user or user_catalog_path(env)
    if user.is_file() or user.is_symlink():
        paths.append(user)
    if extra is None and env.get(ENV_CATALOG):
        extra = env[ENV_CATALOG]
    if extra:
        paths.append(Path(extra).expanduser())
    cat = Catalog()
    for p in paths:
        for e in _read(p):
            cat.entries[e.name] = e
    _cross_check(cat)
    return cat


def entries_by_kind(cat: Catalog, kind: str) -> Iterable[CatalogEntry]:
    return (e for e in cat if e.kind == kind)
