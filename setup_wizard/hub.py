"""Verified downloads of pinned catalog entries into the store.

`hf` entries go through huggingface_hub's own pieces: `hf_hub_url` (honours HF_ENDPOINT), `get_hf_file_metadata`
(HEAD: size, commit), `http_get` (its session, retries, and Range resume within a run), `build_hf_headers`
(HF_TOKEN), `HfApi.parse_safetensors_file_metadata` (ranged read of a safetensors header). Around them we add what
the library does not do: sha256 computed while the bytes are written (the file is never read twice), a `.part` file
that a later run resumes with a Range request (re-hashing the bytes already there), a disk-space check, progress
reported through a callback, a header check of DFlash2 weights against the contract *before* they are downloaded,
and an atomic rename into the store once size and sha256 match the catalog. `bundled` entries are copied from the
package folder through the same hashing and checks. Offline (HF_HUB_OFFLINE or `offline=True`) serves only what the
store has verified.

Each entry is fetched under its item lock (two runs never append to one `.part`), every file is opened inside its
folder without following links (setup_wizard/store_fs.py), and a verified copy is re-hashed before it is reused
(docs/store.md, "Trust"). Bytes reach the `.part` file in steps of at most `RESUME_STEP`, unbuffered, so a link that
drops often still makes progress.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import ContractError, StrataError, WorkError
from runtime.progress import ProgressFn
from setup_wizard.catalog import (
    Catalog,
    CatalogEntry,
    CatalogError,
    bundled_root,
    check_relpath,
    load_catalog,
    safe_join,
)
from setup_wizard.store import (
    PART_SUFFIX,
    Store,
    StoreError,
    check_disk_space,
    manifest_sha256,
    now_iso,
)
from setup_wizard.store_fs import open_dir, open_file, os_error_sentence, unlink_tmp_files, writing
from setup_wizard.store_locks import item_lock

RESUME_STEP = 256 << 10     # bytes per write to the .part file: progress a dropped connection never loses


class DownloadError(WorkError, OSError):
    """A download or its verification failed (network, missing file, checksum); exit code 1."""


class ChecksumError(DownloadError):
    """A file's bytes do not match the catalog's sha256 or size; nothing of it is kept."""


class HeaderCheckError(ContractError):
    """The remote safetensors header breaks the DFlash2 contract; the weights were not downloaded (exit code 2:
    the checkpoint itself is bad input, retrying cannot help)."""


class UnpinnedError(CatalogError):
    """The entry has no full pin, so it is never downloaded (exit code 2)."""


@dataclass(frozen=True)
class Pulled:
    """A verified catalog entry in the store."""

    name: str
    kind: str
    path: Path                                  # the folder holding the files
    revision: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)   # rel path -> {sha256, size}
    sha256: str = ""                            # manifest hash over the files (store.manifest_sha256)
    size: int = 0
    reused: bool = False                        # True when nothing had to be fetched


def _is_true(v: str | None) -> bool:
    return (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hf_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now, as huggingface_hub reads it."""
    return _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


def hf_endpoint() -> str:
    """HF_ENDPOINT read now (huggingface_hub reads it once at import; tests and users may set it later)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _revision_dir(entry: CatalogEntry) -> str:
    return entry.revision or ("sha-" + manifest_sha256(_files_of(entry))[:16])


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _files_of(entry: CatalogEntry) -> dict[str, dict[str, Any]]:
    return {f.path: {"sha256": f.sha256, "size": f.size} for f in entry.files}


def entry_dir(entry: CatalogEntry, store: Store) -> Path:
    if entry.repo is None:
        raise UnpinnedError(entry.unpinned_message())
    return store.download_dir(entry.repo, _revision_dir(entry), entry.source)


def verified_entry(entry: CatalogEntry, store: Store | None = None, *, rehash: bool = False) -> Pulled | None:
    """The entry as already verified in the store (files present with the pinned sizes; any file modified since
    its check, by mtime, is hashed again), else None."""
    store = store or Store()
    if not entry.pinned:
        return None
    d = entry_dir(entry, store)
    m = store.read_manifest(d)
    files = _files_of(entry)
    if not m or not m.get("verified") or m.get("files") != files:
        return None
    if store.verify_files(d, files, rehash=rehash):
        return None
    stamps = m.get("mtime_ns")
    if not rehash and isinstance(stamps, dict):  # (manifests written before stamps existed: sizes only)
        # sizes match; a file written since its check (same size, other bytes) is hashed again before it is used
        touched = {rel: want for rel, want in files.items() if stamps.get(rel) != _mtime_ns(d / rel)}
        if touched and store.verify_files(d, touched, rehash=True):
            return None
    return Pulled(entry.name, entry.kind, d, _revision_dir(entry), files, manifest_sha256(files), entry.size, True)


# ---------------------------------------------------------------------------------------------------------------
# hashing writer + progress

def _write_all(fd: int, data: bytes | memoryview) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


class _HashingWriter:
    """A file object for `http_get` over an O_APPEND descriptor of the `.part` file: hashes every byte written,
    writes it through at once (no buffer a dropped connection could lose) and reports how many."""

    def __init__(self, fd: int, hasher: Any, on_bytes: Callable[[int], None], limit: int | None = None,
                 what: str = "the file") -> None:
        self._fd, self.hasher, self._on, self._limit, self._what = fd, hasher, on_bytes, limit, what
        self.size = os.fstat(fd).st_size
        self._pos = self.size       # where http_get believes it is (it seeks back when a server ignores Range)

    def write(self, data: bytes) -> int:
        if self._limit is not None and self.size + len(data) > self._limit:
            # a server that sends more than the pin allows never gets to fill the disk
            raise ChecksumError(f"The server sent more than the {self._limit} bytes pinned for {self._what}; "
                                f"the download was discarded. Retry later; if it fails again the source or the "
                                f"pin is wrong.")
        _write_all(self._fd, data)
        self.size += len(data)
        self._pos = self.size
        self.hasher.update(data)
        self._on(len(data))
        return len(data)

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self.size + pos)
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        pos = self._pos if size is None else size
        if pos != 0:
            raise DownloadError("the server restarted a resumed download at an unexpected offset; retry.")
        self.hasher = hashlib.sha256()  # the server ignored our Range: everything comes again from byte 0
        self._on(-1)
        os.ftruncate(self._fd, 0)       # O_APPEND: the next write lands at byte 0 of the emptied file
        self.size = self._pos = 0
        return 0

    def flush(self) -> None:
        pass


class _FileMeter:
    """Bytes of one file so far, reported as `on_progress(label, done, total)` (runtime/progress.py)."""

    def __init__(self, on_progress: ProgressFn | None, label: str, total: int, done: int = 0) -> None:
        self.fn, self.label, self.total, self.done = on_progress, label, total, done
        self._report()

    def _report(self) -> None:
        if self.fn is not None:
            self.fn(self.label, self.done, self.total, "B")

    def add(self, n: int) -> None:
        self.done = 0 if n < 0 else self.done + n     # -1: the server restarted the file from byte 0
        self._report()


def _hash_existing(fd: int, hasher: Any, limit: int) -> int:
    """Feed the bytes already in a .part file to the hasher (the resume point); returns how many."""
    n = 0
    while n < limit and (block := os.pread(fd, min(1 << 22, limit - n), n)):
        hasher.update(block)
        n += len(block)
    return n


def _finish_file(dfd: int, part: str, final: str, rel: str, got_sha: str, want: Mapping[str, Any],
                 name: str) -> None:
    """Rename the checked `.part` to its final name inside the folder `dfd` (a link there is replaced, not
    followed), or delete it when its size or sha256 is not the pin's."""
    size = os.stat(part, dir_fd=dfd, follow_symlinks=False).st_size
    if size != int(want["size"]) or got_sha != want["sha256"]:
        os.unlink(part, dir_fd=dfd)
        what = (f"has {size} bytes instead of {want['size']}" if size != int(want["size"])
                else f"has sha256 {got_sha}, but the catalog pins {want['sha256']}")
        raise ChecksumError(f"Downloaded file {rel} of {name} {what}; it was discarded. Retry with "
                            f"`strata-setup models pull {name}`; if it fails again the source or the pin is wrong.")
    os.replace(part, final, src_dir_fd=dfd, dst_dir_fd=dfd)


# ---------------------------------------------------------------------------------------------------------------
# hf

def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a huggingface_hub error, when it carries a response."""
    resp = getattr(exc, "response", None)
    code = getattr(resp, "status_code", None)
    return code if isinstance(code, int) else None


def access_sentence(exc: BaseException, repo: str) -> str | None:
    """The one sentence for a refused access (401: private, gated or missing without a token; 403: gated or not
    allowed), saying to set HF_TOKEN; None for any other error."""
    from huggingface_hub import errors as E

    ep = hf_endpoint()
    status = http_status(exc)
    token = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    if isinstance(exc, E.GatedRepoError) or (status == 403):
        return (f"{repo} on {ep} is gated and your token may not read it (403); accept its terms on the model page "
                f"with your account, then set HF_TOKEN to a token of that account and retry.")
    if status == 401:
        if token:
            return (f"The Hub at {ep} refused HF_TOKEN for {repo} (401: the token is invalid, or it may not read "
                    f"this private or gated repository); set HF_TOKEN to a token that can read it and retry.")
        return (f"The Hub at {ep} refused access to {repo} (401: it is private or gated, or does not exist); set "
                f"HF_TOKEN to a token that can read it (https://huggingface.co/settings/tokens) and retry.")
    return None


def _hub_error(exc: Exception, entry: CatalogEntry, rel: str | None) -> DownloadError:
    from huggingface_hub import errors as E

    ep = hf_endpoint()
    where = f"{entry.repo}@{entry.revision}"
    refused = access_sentence(exc, entry.repo or entry.name)
    if refused is not None:
        return DownloadError(refused)
    if isinstance(exc, E.RevisionNotFoundError):
        return DownloadError(f"The Hub at {ep} has no revision {entry.revision} of {entry.repo} (entry "
                             f"{entry.name}); check the catalog pin or HF_ENDPOINT.")
    if isinstance(exc, E.EntryNotFoundError | E.RemoteEntryNotFoundError):
        return DownloadError(f"The Hub at {ep} has no file {rel} in {where} (entry {entry.name}); check the "
                             f"catalog entry's file list.")
    if isinstance(exc, E.RepositoryNotFoundError):
        return DownloadError(f"The Hub at {ep} has no repository {entry.repo} (or it is private: set HF_TOKEN).")
    if isinstance(exc, E.HfHubHTTPError):
        return DownloadError(f"The Hub at {ep} refused {rel or entry.repo} of {where}: "
                             f"{str(exc).splitlines()[0]}; retry later.")
    return DownloadError(f"Cannot download {rel or entry.repo} of {where} from {ep} ({type(exc).__name__}: "
                         f"{exc}); check the network and retry, or use --offline with models already in the store.")


def network_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub import errors as E

    errs: list[type[BaseException]] = [E.HfHubHTTPError, ConnectionError, TimeoutError]
    try:
        import httpx

        errs.append(httpx.HTTPError)
    except (ImportError, AttributeError):
        pass
    try:
        import requests

        errs.append(requests.RequestException)
    except (ImportError, AttributeError):
        pass
    try:
        import httpx2  # huggingface_hub 2.x's vendored-name client

        errs.append(httpx2.HTTPError)
    except (ImportError, AttributeError):
        pass
    return tuple(errs)


def _small_steps() -> None:
    """huggingface_hub hands `http_get`'s file the body in DOWNLOAD_CHUNK_SIZE pieces (10 MiB) and loses a piece
    that a dropped connection cut short; smaller pieces keep a flaky link's progress (the value is only lowered)."""
    from huggingface_hub import constants

    constants.DOWNLOAD_CHUNK_SIZE = min(int(constants.DOWNLOAD_CHUNK_SIZE), RESUME_STEP)


def _fetch_hf_file(entry: CatalogEntry, rel: str, want: Mapping[str, Any], dest: Path, store: Store,
                   on_progress: ProgressFn | None) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    check_relpath(rel, f"{entry.name} file")
    final = dest / rel
    part = final.name + PART_SUFFIX
    size = int(want["size"])
    url = hf_hub_url(entry.repo, rel, revision=entry.revision, endpoint=hf_endpoint())
    headers = build_hf_headers()
    try:
        meta = get_hf_file_metadata(url, headers=headers)
    except network_errors() as exc:
        raise _hub_error(exc, entry, rel) from None
    if meta.size is not None and meta.size != size:
        raise ChecksumError(f"The Hub reports {meta.size} bytes for {rel} of {entry.name}, but the catalog pins "
                            f"{want['size']}; the file was not downloaded (the pin or the repository is wrong).")
    if meta.commit_hash and meta.commit_hash != entry.revision:
        raise DownloadError(f"The Hub served {rel} of {entry.name} from commit {meta.commit_hash}, not the pinned "
                            f"{entry.revision}; refusing it.")
    location = meta.location or url
    if url_origin(location) != url_origin(url):
        # an LFS blob on a CDN: the token stays on the Hub (as hf_hub_download does)
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    _small_steps()
    with open_dir(store.root, final.parent) as dfd:
        fd = open_file(dfd, part, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        try:
            hasher = hashlib.sha256()
            resume = os.fstat(fd).st_size
            if resume > size:
                os.ftruncate(fd, 0)
                resume = 0
            resume = _hash_existing(fd, hasher, resume)
            meter = _FileMeter(on_progress, f"{entry.name}/{rel}", size, resume)
            w = _HashingWriter(fd, hasher, meter.add, size, f"{rel} of {entry.name}")
            try:
                http_get(location, w, resume_size=resume, headers=headers, expected_size=size,
                         displayed_filename=rel)
            except network_errors() + (OSError,) as exc:
                raise _fetch_failure(exc, entry, rel, w.size, size, dfd, part, store) from None
            hasher = w.hasher
        finally:
            os.close(fd)
        _finish_file(dfd, part, final.name, rel, hasher.hexdigest(), want, entry.name)


def _fetch_failure(exc: BaseException, entry: CatalogEntry, rel: str, kept: int, size: int, dfd: int, part: str,
                   store: Store) -> BaseException:
    """The one sentence for a download that stopped: what happened, and that the bytes kept resume next time."""
    if isinstance(exc, ChecksumError):
        try:
            os.unlink(part, dir_fd=dfd)
        except FileNotFoundError:
            pass
        return exc
    if isinstance(exc, StrataError):
        return exc
    resume = f"{kept} of {size} bytes are kept in {part}; `strata-setup models pull {entry.name}` resumes from there"
    network = isinstance(exc, network_errors())
    if isinstance(exc, OSError) and not network:
        better = os_error_sentence(exc, store.root, f"{rel} of {entry.name}",
                                   then=f"run `strata-setup models pull {entry.name}` to resume ({kept} of {size} "
                                        f"bytes are kept)")
        if better is not None:
            return better
        if kept < size:   # the server ended the body early without an error (huggingface_hub's size check)
            return DownloadError(f"The server sent only {kept} of the {size} bytes of {rel} of {entry.name} and "
                                 f"ended the file there; {resume} (if it stops short again, the server's copy is "
                                 f"incomplete).")
        if exc.errno is not None:
            return StoreError(f"Cannot write {rel} of {entry.name} into {store.root} ({exc.strerror or exc}); "
                              f"{resume}.")
    err = _hub_error(exc, entry, rel)  # type: ignore[arg-type]
    return DownloadError(f"{err} ({resume}.)")


def url_origin(url: str) -> tuple[str, str, int | None]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return (u.scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(u.scheme))


def check_remote_header(entry: CatalogEntry, config_path: Path) -> None:
    """Ranged read of each safetensors header; ContractError -> HeaderCheckError, before any weight is fetched. A
    `dflash` entry may hold the v1 layout (docs/formats.md)."""
    from huggingface_hub import HfApi

    from runtime.drafters.dflash2.contract import DFlash2Geometry, check_inventory

    weights = [f.path for f in entry.files if f.path.endswith(".safetensors")]
    if not weights:
        raise HeaderCheckError(f"Entry {entry.name} lists no .safetensors weights; a DFlash2 head needs them.")
    try:
        geom = DFlash2Geometry.from_config(json.loads(config_path.read_text(encoding="utf-8")))
    except (ContractError, ValueError) as exc:
        raise HeaderCheckError(f"Refusing {entry.name}: its config.json breaks the DFlash2 contract ({exc}).") \
            from None
    api = HfApi(endpoint=hf_endpoint())
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for rel in weights:
        try:
            meta = api.parse_safetensors_file_metadata(entry.repo, rel, revision=entry.revision)
        except network_errors() as exc:
            raise _hub_error(exc, entry, rel) from None
        except Exception as exc:  # SafetensorsParsingError and friends
            raise HeaderCheckError(f"Refusing {entry.name}: the header of {rel} cannot be read ({exc}).") from None
        for name, info in meta.tensors.items():
            found[name] = (tuple(int(s) for s in info.shape), str(info.dtype))
    try:
        check_inventory(found, geom, allow_v1=entry.kind == "dflash")
    except ContractError as exc:
        raise HeaderCheckError(f"Refusing {entry.name} without downloading its weights: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# bundled

def _copy_bundled_file(entry: CatalogEntry, rel: str, want: Mapping[str, Any], dest: Path, store: Store,
                       on_progress: ProgressFn | None, root: Path) -> None:
    src_dir = safe_join(root, entry.repo or "", f"{entry.name} bundled folder")
    src = safe_join(src_dir, rel, f"{entry.name} file")
    if not src.is_file():
        raise DownloadError(f"The bundled file {rel} of {entry.name} is missing from {src_dir}; reinstall "
                            f"strata-setup.")
    check_relpath(rel, f"{entry.name} file")
    final = dest / rel
    part = final.name + PART_SUFFIX
    hasher = hashlib.sha256()
    meter = _FileMeter(on_progress, f"{entry.name}/{rel}", int(want["size"]))
    with open_dir(store.root, final.parent) as dfd:
        fd = open_file(dfd, part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with open(src, "rb") as fi:
                while block := fi.read(1 << 22):
                    hasher.update(block)
                    _write_all(fd, block)
                    meter.add(len(block))
        finally:
            os.close(fd)
        _finish_file(dfd, part, final.name, rel, hasher.hexdigest(), want, entry.name)


# ---------------------------------------------------------------------------------------------------------------
# the entry point

def _waiter(on_progress: ProgressFn | None) -> Callable[[str], None] | None:
    if on_progress is None:
        return None
    return lambda msg: on_progress(msg, 0, None, "")


def download_entry(entry: CatalogEntry, store: Store | None = None, *, offline: bool | None = None,
                   on_progress: ProgressFn | None = None, bundled_dir: Path | None = None,
                   rehash: bool = True) -> Pulled:
    """Make `entry` present and verified in the store; returns where. A verified copy is reused after its files
    are hashed again (`rehash`; setup and pull always do). Holds the entry's lock while it works (inside
    `store_locks.hold_locks`, until that block ends). Raises UnpinnedError / HeaderCheckError /
    StoreNotWritable (exit 2), DownloadError / ChecksumError / StoreError (exit 1)."""
    store = store or Store()
    if not entry.pinned:
        raise UnpinnedError(entry.unpinned_message())
    dest = entry_dir(entry, store)
    with writing(store.root, entry.name), item_lock(store.root, dest, what=entry.name,
                                                    on_wait=_waiter(on_progress)):
        unlink_tmp_files(store.root, dest)     # what an interrupted manifest write left behind
        have = verified_entry(entry, store, rehash=rehash)
        if have is not None:
            return have
        offline = hf_offline() if offline is None else offline
        if offline and entry.source == "hf":
            raise DownloadError(f"{entry.name} is not verified in the store and offline mode is on (--offline or "
                                f"HF_HUB_OFFLINE); run `strata-setup models pull {entry.name}` once with network "
                                f"access.")
        return _download(entry, store, dest, on_progress, bundled_dir)


def _download(entry: CatalogEntry, store: Store, dest: Path, on_progress: ProgressFn | None,
              bundled_dir: Path | None) -> Pulled:
    files = _files_of(entry)
    store.invalidate(dest)  # whatever was there is not verified for this pin any more
    # Files left under their final name by an interrupted run passed their check then, but the folder has no
    # verified manifest now (it may have failed `models verify`), so they are hashed again before being kept.
    missing = [rel for rel in files if store.verify_files(dest, {rel: files[rel]}, rehash=True)]
    part_bytes = 0
    for rel in missing:
        check_relpath(rel, f"{entry.name} file")
        p = dest / rel
        pp = p.with_name(p.name + PART_SUFFIX)
        part_bytes += pp.lstat().st_size if pp.is_file() and not pp.is_symlink() else 0
        if os.path.lexists(p):
            with open_dir(store.root, p.parent) as dfd:
                os.unlink(p.name, dir_fd=dfd)  # present but wrong (or a link): never used
    need = sum(int(files[r]["size"]) for r in missing) - part_bytes
    check_disk_space(store, max(need, 0), dest, f"{entry.name}")
    # small files first (config.json), so a DFlash2 head's header can be checked before its weights move
    order = sorted(missing, key=lambda r: (r.endswith(".safetensors"), files[r]["size"], r))
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hf_bars_were_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        header_checked = False
        for rel in order:
            if entry.source == "bundled":
                _copy_bundled_file(entry, rel, files[rel], dest, store, on_progress, bundled_dir or bundled_root())
                continue
            if entry.is_head and rel.endswith(".safetensors") and not header_checked:
                cfg = dest / "config.json"
                if not cfg.is_file():
                    raise HeaderCheckError(f"Entry {entry.name} does not list config.json; a DFlash2 head "
                                           f"needs it.")
                check_remote_header(entry, cfg)
                header_checked = True
            _fetch_hf_file(entry, rel, files[rel], dest, store, on_progress)
    finally:
        if not hf_bars_were_off:
            enable_progress_bars()
    problems = store.verify_files(dest, files, rehash=False)
    if problems:
        raise StoreError(f"{entry.name} is incomplete after download ({problems[0]}); retry the pull.")
    doc = {"kind": "download", "name": entry.name, "entry_kind": entry.kind, "source": entry.source,
           "repo": entry.repo, "revision": entry.revision, "files": files, "size": entry.size,
           "sha256": manifest_sha256(files), "verified": True, "verified_at": now_iso(),
           "mtime_ns": {rel: _mtime_ns(dest / rel) for rel in files}}
    store.write_manifest(dest, doc)
    return Pulled(entry.name, entry.kind, dest, _revision_dir(entry), files, doc["sha256"], entry.size, False)


def pull(name: str, *, store: Store | None = None, catalog: Catalog | None = None, offline: bool | None = None,
         on_progress: ProgressFn | None = None) -> Pulled:
    """Download and verify one catalog entry by name (and nothing else); a verified copy is hashed again first."""
    cat = catalog or load_catalog()
    return download_entry(cat.get(name), store, offline=offline, on_progress=on_progress)
