"""The seam between the plan and the parts that do the work: the `Services` protocol (catalog, verified download,
conversion, calibration), the records it returns, and `RealServices`, which calls the real parts. The plan is tested
with fakes through this seam, and the question layer never touches the parts themselves. Long steps report through
a progress callback (runtime/progress.py); the command line draws it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from calibrate.api import DEFAULT_MAX_SECONDS, calibrate_for_config
from calibrate.results import CalibrationResult
from runtime.formats.gguf_split import part_names
from runtime.progress import ProgressFn
from setup_wizard import catalog as C
from setup_wizard import convert as V
from setup_wizard import hub as H
from setup_wizard.config import manifest_sha256


@dataclass(frozen=True)
class TargetOption:
    name: str
    source: str  # "bundled" | "hf" | "local"
    local_path: Path | None = None  # where it is when already here (bundled, downloaded or a local folder)
    pinned: bool = True
    size_bytes: int = 0
    has_mtp: bool | None = None
    description: str = ""
    repo: str | None = None  # hf: the Hub repository (an unpinned suggestion can be pinned from it)
    gguf: bool = False  # a GGUF file from the Hub: run as it is stored (never converted)
    quant: str | None = None  # a GGUF file's storage as its catalog entry records it (known before the download)

    @property
    def available(self) -> bool:
        return self.local_path is not None


@dataclass(frozen=True)
class HeadOption:
    name: str
    default: bool = False
    pinned: bool = True
    size_bytes: int = 0
    local_path: Path | None = None
    description: str = ""
    repo: str | None = None  # hf: the Hub repository (an unpinned suggestion can be pinned from it)


@dataclass(frozen=True)
class Artifact:
    """A verified file or folder in the store with what the config records about it."""

    path: Path
    sha256: str
    size: int = 0
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # folder artifacts: rel path → sha256, size
    revision: str | None = None
    reused: bool = False  # True when nothing had to be fetched or built
    source_sha256: str | None = None  # converted artifacts: the sha256 of what they were converted from
    repo: str | None = None
    name: str = ""  # the catalog entry (or local head folder) it is; a conversion records it as its source


class Services(Protocol):
    def targets(self) -> list[TargetOption]: ...
    def heads(self, target: str) -> list[HeadOption]: ...
    def fetch(self, name: str, *, offline: bool) -> Artifact: ...
    def remote_geometry(self, name: str) -> Any | None: ...
    def convert(self, head_dir: Path, quant: str, *, source: Artifact) -> Artifact: ...
    def convert_target(self, folder: Path, quant: str, *, source: Artifact) -> Artifact: ...
    def calibrate(self, doc: dict[str, Any], *, force: bool, max_seconds: float | None) -> CalibrationResult: ...
    def compile_steps(self, doc: dict[str, Any]) -> str: ...
    def add_from_hub(self, repo: str, *, name: str | None, kind: str | None, show: Callable[[Any], None],
                     confirm: Callable[[Any], bool],
                     choose_file: Callable[[list[tuple[str, int]]], str | None] | None = None) -> Any | None: ...


class RealServices:
    """Catalog, verified download, conversion and calibration, by the parts that own them; `on_progress` receives
    their progress (the command line turns it into bars on stderr)."""

    def __init__(self, on_progress: ProgressFn | None = None, threads: int | None = None) -> None:
        self.on_progress = on_progress
        self.threads = threads      # CPU threads for calibration (None: measured, runtime/hostinfo.py)

    def targets(self) -> list[TargetOption]:
        return [TargetOption(name=e.name, source=e.source, local_path=_local_copy(e), pinned=e.pinned,
                             size_bytes=e.size, has_mtp=e.mtp, description=e.description,
                             repo=e.repo if e.source == "hf" else None, gguf=e.gguf_file is not None,
                             quant=e.quant)
                for e in C.load_catalog().targets()]

    def heads(self, target: str) -> list[HeadOption]:
        return [HeadOption(name=e.name, default=e.default, pinned=e.pinned, size_bytes=e.size,
                           local_path=_local_copy(e), description=e.description,
                           repo=e.repo if e.source == "hf" else None)
                for e in C.load_catalog().heads(target)]

    def add_from_hub(self, repo: str, *, name: str | None, kind: str | None, show: Callable[[Any], None],
                     confirm: Callable[[Any], bool],
                     choose_file: Callable[[list[tuple[str, int]]], str | None] | None = None) -> Any | None:
        """Pin a Hub repository into the user catalog, as `strata-setup models add` does (setup_wizard/hub_add.py);
        the `Found` written, or None when `confirm` declined. `choose_file` picks one file of a GGUF repository."""
        from setup_wizard.hub_add import add_model

        found, written = add_model(repo, name=name, kind=kind, show=show, confirm=confirm, choose_file=choose_file)
        return found if written else None

    def remote_geometry(self, name: str) -> Any | None:
        """A GGUF catalog target's budget geometry before its download, from its header on the Hub
        (`hub_add.remote_gguf_geometry`); None for other entries, offline, or when the Hub cannot answer (setup then
        budgets it once it is here)."""
        from runtime.errors import StrataError
        from setup_wizard.hub_add import remote_gguf_geometry

        try:
            entry = C.load_catalog().get(name)
            if entry.gguf_file is None or H.hf_offline():
                return None
            return remote_gguf_geometry(entry)
        except (StrataError, OSError, ValueError, *H.network_errors()):
            return None

    def fetch(self, name: str, *, offline: bool) -> Artifact:
        pulled = H.pull(name, offline=True if offline else None, on_progress=self.on_progress)
        entry = C.load_catalog().get(name)
        path, sha = Path(pulled.path), pulled.sha256
        if entry.gguf_file is not None:     # the file itself, and its sha256 as a local GGUF target's (hash_target)
            parts = part_names(entry.gguf_file)
            path = path / entry.gguf_file
            sha = (pulled.files[entry.gguf_file]["sha256"] if len(parts) == 1
                   else manifest_sha256({n: pulled.files[n] for n in parts}))
        return Artifact(path=path, sha256=sha, size=pulled.size, files=dict(pulled.files),
                        revision=pulled.revision, reused=pulled.reused, repo=entry.repo, name=name)

    def convert(self, head_dir: Path, quant: str, *, source: Artifact) -> Artifact:
        report = self.on_progress

        def on_tensor(name: str, i: int, n: int) -> None:
            if report is not None:
                report(f"convert → {quant}", i, n)

        res = V.convert_to_store(head_dir, quant, source_name=source.name, source_repo=source.repo or "",
                                 source_revision=source.revision or "", on_tensor=on_tensor)
        return Artifact(path=Path(res.path), sha256=res.sha256, size=res.size, reused=res.reused,
                        source_sha256=res.source_sha256)

    def convert_target(self, folder: Path, quant: str, *, source: Artifact) -> Artifact:
        """The target folder as a GGUF at `quant` in the store (setup_wizard/convert_target.py), keyed by the
        folder's manifest hash; the artifact's files are the GGUF files relative to their folder."""
        from setup_wizard.convert_target import convert_target_to_store

        report = self.on_progress

        def on_tensor(name: str, i: int, n: int) -> None:
            if report is not None:
                report(f"convert target → {quant}", i, n)

        res = convert_target_to_store(folder, quant, source_name=Path(folder).name, source_repo=source.repo or "",
                                      source_revision=source.revision or "", source_sha=source.sha256,
                                      on_tensor=on_tensor)
        files = {res.path.name: {"sha256": res.sha256, "size": res.size}}
        if res.mtp_path is not None:
            files[res.mtp_path.name] = {"sha256": res.mtp_sha256, "size": res.mtp_size}
        return Artifact(path=Path(res.path), sha256=res.sha256, size=res.total_size, files=files, reused=res.reused,
                        source_sha256=res.source_sha256, revision=source.revision, repo=source.repo)

    def compile_steps(self, doc: dict[str, Any]) -> str:
        """Build the compiled CPU steps this config runs (the target's, and the MTP chain's) into the store, or
        load them when this machine has them. Returns "" when the target's are there, else why not."""
        from runtime.engine import Engine

        what = "compiling the CPU steps (once per machine)"
        if self.on_progress is not None:
            self.on_progress(what, 0, 1)
        eng = Engine.from_config(doc)
        eng.compile_missing(lambda m: None)
        if self.on_progress is not None:
            self.on_progress(what, 1, 1)
        return eng.target_why

    def calibrate(self, doc: dict[str, Any], *, force: bool, max_seconds: float | None) -> CalibrationResult:
        budget = DEFAULT_MAX_SECONDS if max_seconds is None else max_seconds
        return calibrate_for_config(doc, force=force, max_seconds=budget, on_progress=self.on_progress,
                                    threads=self.threads)


def _local_copy(entry: C.CatalogEntry) -> Path | None:
    """Where a catalog entry already is: the store's verified copy (by pinned revision), or the bundled folder
    shipped with the package (the download step copies and verifies it into the store)."""
    if entry.pinned:
        try:
            pulled = H.verified_entry(entry)
        except Exception:  # a store that cannot answer means "not here"; the download step will say why
            pulled = None
        if pulled is not None:
            return Path(pulled.path) / entry.gguf_file if entry.gguf_file else Path(pulled.path)
    if entry.source == "bundled" and entry.repo:
        folder = C.safe_join(C.bundled_root(), entry.repo, f"catalog entry {entry.name!r} repo")
        if folder.is_dir() and all((folder / f.path).is_file() for f in entry.files):
            return folder
    return None
