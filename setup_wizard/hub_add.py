"""`strata-setup models add`: pin a Hugging Face Hub repository on first use (docs/commands.md, "Adding a model from
the Hub").

A pin is never guessed; it is taken from the Hub itself: the revision asked for (a branch, tag or commit) resolved to
its full commit by `HfApi.model_info(..., files_metadata=True)`, each LFS file's size and sha256 as the Hub publishes
them, and each small (non-LFS) file downloaded at that commit, checked against its published size and git blob id,
and hashed. What the repository holds comes from config.json and the safetensors headers, read with ranged requests
(no weights): a qwen3_moe target, checked tensor by tensor as strata-run will load it (with or without an MTP head),
or a DFlash2 / DFlash v1 head, checked against the contract and matched to the catalog targets it fits. The entry is
then written to the user catalog (`$STRATA_HOME/catalog.toml`) atomically, under its lock; from then on `models
pull` and setup treat it like every pinned entry (bytes checked against the pin while they stream).

File names from the Hub are untrusted: only the files the runtime needs are taken (config.json, the tokenizer
files, generation_config.json, the safetensors index and the shards it names, or model.safetensors), each checked as
a clean relative path; code (`.py`) and pickles are never taken.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.drafters.dflash2.contract import DFlash2Geometry, check_inventory, pairing_problem
from runtime.errors import ConfigError, ContractError, StrataError, UsageError, WorkError, one_of
from runtime.fileio import atomic_write_text
from runtime.formats.safetensors_files import INDEX, SINGLE
from setup_wizard.catalog import (
    HEAD_KINDS,
    Catalog,
    CatalogEntry,
    CatalogError,
    bundled_root,
    check_relpath,
    load_catalog,
    safe_join,
    shipped_catalog_path,
    user_catalog_path,
)
from setup_wizard.hub import (
    access_sentence,
    hf_endpoint,
    hf_offline,
    network_errors,
    url_origin,
    verified_entry,
)
from setup_wizard.inspection import TARGET_FILES
from setup_wizard.store import Store
from setup_wizard.store_fs import open_dir, writing
from setup_wizard.store_locks import store_lock

ADD_KINDS = ("target", "dflash2", "dflash")
SMALL_LIMIT = 64 << 20          # a file downloaded whole to be hashed or read (config, index, tokenizer)
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
HEAD_ARCHS = {"DFlash2DraftModel", "DFlashDraftModel"}
HEADER = ("# Your model catalog: entries pinned by `strata-setup models add` (docs/store.md, \"Catalog\").\n"
          "# Every revision and sha256 here was read from the Hub; entries replace shipped ones of the same name.\n")


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str
    lfs: bool


@dataclass
class Found:
    """What a Hub repository holds, pinned: what `models add` shows and then writes."""

    repo: str
    ref: str                                   # what was asked for: a branch, tag or commit
    revision: str                              # the full commit it resolved to
    name: str
    kind: str                                  # target | dflash2 | dflash
    files: list[RemoteFile]
    geometry: dict[str, Any]
    summary: str                               # the geometry in words
    mtp: bool | None = None                    # targets: has an MTP head
    drafters: list[str] = field(default_factory=list)   # targets: the drafters it can run with
    heads: list[str] = field(default_factory=list)      # targets: catalog heads that fit it
    fits: list[str] = field(default_factory=list)       # heads: catalog targets it fits
    ready: list[str] = field(default_factory=list)      # heads: those of `fits` that are pinned (can be set up)
    replaces: str | None = None                # the catalog entry of this name it replaces, in words
    quant: str | None = None                   # a GGUF target: how its file stores the experts (e.g. "q4_k")
    notes: list[str] = field(default_factory=list)
    free_bytes: int = 0
    catalog: Path = Path()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_head(self) -> bool:
        return self.kind in HEAD_KINDS

    def entry_doc(self) -> dict[str, Any]:
        """The `[[entry]]` table written to the user catalog."""
        doc: dict[str, Any] = {"name": self.name, "kind": self.kind, "source": "hf", "repo": self.repo,
                               "revision": self.revision}
        if self.is_head:
            doc.update(fits=list(self.fits), default=False)
        else:
            doc["mtp"] = bool(self.mtp)
        if self.quant:
            doc["quant"] = self.quant
        doc["description"] = f"{self.summary}; pinned from {self.repo} at {self.ref} by strata-setup models add"
        doc["file"] = [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files]
        return doc

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "repo": self.repo, "ref": self.ref, "revision": self.revision,
                "summary": self.summary, "geometry": self.geometry, "mtp": self.mtp, "drafters": self.drafters,
                "heads": self.heads, "fits": self.fits, "ready": self.ready, "size": self.size,
                "free_bytes": self.free_bytes, "replaces": self.replaces, "notes": self.notes, "catalog": str(self.catalog),
                "quant": self.quant,
                "files": [{"path": f.path, "sha256": f.sha256, "size": f.size, "lfs": f.lfs} for f in self.files]}

    def lines(self) -> list[str]:
        """What was found, in words (the command line and the wizard print these)."""
        ref = self.ref if self.ref == self.revision else f"{self.ref} = commit {self.revision}"
        out = [f"{self.repo} at {ref}", f"  kind:      {_kind_words(self.kind, self.quant)}",
               f"  geometry:  {self.summary}"]
        if self.is_head:
            out.append(f"  fits:      {', '.join(self.fits)} (targets in your catalog with its hidden size, "
                       f"vocabulary and layer count)")
        else:
            out.append(f"  MTP head:  {'yes' if self.mtp else 'no'}")
            how = one_of(self.drafters)
            heads = (f"; catalog heads that fit it: {', '.join(self.heads)}" if self.heads
                     else "; no head in the catalog fits it yet (add one with `strata-setup models add ORG/HEAD`)")
            out.append(f"  drafters:  {how}{heads if 'dflash2' in self.drafters else ''}")
        n = len(self.files)
        out.append(f"  files:     {n} ({', '.join(f.path for f in self.files[:6])}{', ...' if n > 6 else ''})")
        out.append(f"  download:  {_size(self.size)} ({self.size:,} bytes); {_size(self.free_bytes)} free under "
                   f"{self.catalog.parent}")
        out.append(f"  name:      {self.name}" + (f" (replaces {self.replaces})" if self.replaces else ""))
        out += [f"  note:      {n}" for n in self.notes]
        return out


def _kind_words(kind: str, quant: str | None = None) -> str:
    if kind == "target" and quant:
        return f"target (a llama.cpp qwen3moe GGUF file, {quant.upper()}; run as it is stored)"
    return {"target": "target (qwen3_moe)", "dflash2": "DFlash2 head", "dflash": "DFlash head (v1 layout: no "
            "convolutions or selector; run by the dflash2 drafter)"}[kind]


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------------------------------------------
# errors

def add_error(exc: BaseException, repo: str, ref: str, rel: str | None = None) -> StrataError:
    """One sentence for a Hub error met while adding: refused access (HF_TOKEN) and network failures exit 1, a
    repository or revision that does not exist exits 2."""
    from huggingface_hub import errors as E

    if isinstance(exc, StrataError):
        return exc
    ep = hf_endpoint()
    refused = access_sentence(exc, repo)
    if refused is not None:
        return WorkError(refused)
    if isinstance(exc, E.RevisionNotFoundError):
        return UsageError(f"{repo} on {ep} has no branch, tag or commit {ref!r}; check --revision.")
    if isinstance(exc, E.EntryNotFoundError | E.RemoteEntryNotFoundError):
        return WorkError(f"The Hub at {ep} lists {rel} in {repo} at {ref} but does not serve it; retry later.")
    if isinstance(exc, E.RepositoryNotFoundError):
        return UsageError(f"There is no model repository {repo} on {ep}; check the id (it is case-sensitive, like "
                          f"Qwen/Qwen3-30B-A3B).")
    if isinstance(exc, E.HfHubHTTPError):
        return WorkError(f"The Hub at {ep} refused {rel or repo} of {repo} at {ref}: {str(exc).splitlines()[0]}; "
                         f"retry later.")
    return WorkError(f"Cannot reach the Hub at {ep} for {repo} ({type(exc).__name__}: {exc}); check the network "
                     f"and HF_ENDPOINT, then retry.")


# ---------------------------------------------------------------------------------------------------------------
# reading the Hub

class _Capped(io.BytesIO):
    """An in-memory file for `http_get` that refuses more than `limit` bytes."""

    def __init__(self, limit: int, what: str) -> None:
        super().__init__()
        self.limit, self.what = limit, what

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.limit:
            raise UsageError(f"{self.what} is larger than {_size(self.limit)}; it is not a file Strata reads.")
        return super().write(data)


@contextmanager
def _quiet_bars() -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    were_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not were_off:
            enable_progress_bars()


def fetch_small(repo: str, rel: str, revision: str, *, commit: str | None = None,
                limit: int = SMALL_LIMIT) -> bytes:
    """The bytes of one small file of `repo` at `revision` (a commit when `commit` is given: the Hub must serve it
    from that commit). Errors of the Hub are raised as huggingface_hub raises them."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, rel, revision=revision, endpoint=hf_endpoint())
    headers = build_hf_headers()
    meta = get_hf_file_metadata(url, headers=headers)
    what = f"{rel} of {repo}"
    if meta.size is not None and meta.size > limit:
        raise UsageError(f"{what} is larger than {_size(limit)}; it is not a file Strata reads.")
    if commit and meta.commit_hash and meta.commit_hash != commit:
        raise WorkError(f"The Hub served {what} from commit {meta.commit_hash}, not {commit}; retry.")
    location = meta.location or url
    if url_origin(location) != url_origin(url):       # a CDN: the token stays on the Hub
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    buf = _Capped(limit, what)
    with _quiet_bars():
        http_get(location, buf, headers=headers, expected_size=meta.size, displayed_filename=rel)
    return buf.getvalue()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repo:
    """One Hub repository at one commit: its published file list, and verified reads of it."""

    def __init__(self, repo: str, ref: str, info: Any) -> None:
        self.repo, self.ref, self.commit = repo, ref, str(info.sha or "")
        if not _HEX40.fullmatch(self.commit):
            raise WorkError(f"The Hub answered no full commit for {repo} at {ref} (got {info.sha!r}); retry later.")
        self.siblings: dict[str, Any] = {s.rfilename: s for s in (info.siblings or [])}
        self.cache: dict[str, bytes] = {}

    def where(self) -> str:
        return f"{self.repo} at {self.ref}"

    def has(self, rel: str) -> bool:
        return rel in self.siblings

    def pin(self, rel: str) -> RemoteFile:
        """Size and sha256 of one file: an LFS file's as the Hub publishes them; a small file's by downloading it at
        the commit (checked against its published size and git blob id)."""
        check_relpath(rel, f"{self.where()}: file")
        sib = self.siblings.get(rel)
        if sib is None:
            raise UsageError(f"{self.where()} has no file {rel}.")
        size = sib.size
        if not isinstance(size, int) or size < 0:
            raise WorkError(f"The Hub published no size for {rel} of {self.where()}; retry later.")
        lfs = getattr(sib, "lfs", None)
        if lfs is not None:
            sha = str(getattr(lfs, "sha256", "") or "").lower()
            if not _HEX64.fullmatch(sha) or int(getattr(lfs, "size", -1)) != size:
                raise WorkError(f"The Hub's LFS metadata for {rel} of {self.where()} is incomplete (sha256 "
                                f"{sha or 'missing'}, size {getattr(lfs, 'size', None)}); retry later.")
            return RemoteFile(rel, size, sha, True)
        return RemoteFile(rel, size, hashlib.sha256(self.read(rel)).hexdigest(), False)

    def read(self, rel: str) -> bytes:
        """A small file's bytes at the commit, checked against the Hub's own metadata for it."""
        if rel in self.cache:
            return self.cache[rel]
        check_relpath(rel, f"{self.where()}: file")
        sib = self.siblings.get(rel)
        if sib is None:
            raise UsageError(f"{self.where()} has no file {rel}.")
        try:
            data = fetch_small(self.repo, rel, self.commit, commit=self.commit)
        except network_errors() as exc:
            raise add_error(exc, self.repo, self.ref, rel) from None
        lfs = getattr(sib, "lfs", None)
        if sib.size is not None and len(data) != sib.size:
            raise WorkError(f"{rel} of {self.where()} arrived with {len(data)} bytes, but the Hub lists "
                            f"{sib.size}; retry.")
        if lfs is not None and hashlib.sha256(data).hexdigest() != str(lfs.sha256).lower():
            raise WorkError(f"{rel} of {self.where()} does not match the sha256 the Hub publishes for it; retry.")
        if lfs is None and sib.blob_id and git_blob_id(data) != sib.blob_id:
            raise WorkError(f"{rel} of {self.where()} does not match the git blob id the Hub publishes for it; "
                            f"retry.")
        self.cache[rel] = data
        return data

    def json(self, rel: str) -> dict[str, Any]:
        try:
            doc = json.loads(self.read(rel).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise UsageError(f"{rel} of {self.where()} is not valid JSON.") from None
        if not isinstance(doc, dict):
            raise UsageError(f"{rel} of {self.where()} is not a JSON object.")
        return doc

    def header(self, rel: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """{tensor: (shape, dtype)} of one safetensors file, from its header (a ranged read; no weights)."""
        from huggingface_hub import HfApi

        try:
            meta = HfApi(endpoint=hf_endpoint()).parse_safetensors_file_metadata(self.repo, rel,
                                                                                 revision=self.commit)
        except network_errors() as exc:
            raise add_error(exc, self.repo, self.ref, rel) from None
        except Exception as exc:  # SafetensorsParsingError and friends: the file itself is bad
            raise UsageError(f"The header of {rel} in {self.where()} cannot be read as safetensors ({exc}).") \
                from None
        return {str(n): (tuple(int(s) for s in t.shape), str(t.dtype)) for n, t in meta.tensors.items()}


def open_repo(repo: str, revision: str | None) -> _Repo:
    from huggingface_hub import HfApi

    ref = revision or "main"
    if hf_offline():
        raise UsageError("`models add` reads the Hub, but offline mode is on (HF_HUB_OFFLINE); unset it and retry.")
    if not isinstance(repo, str) or not _REPO.fullmatch(repo):
        raise UsageError(f"{repo!r} is not a Hub repository id like 'Qwen/Qwen3-30B-A3B'.")
    try:
        info = HfApi(endpoint=hf_endpoint()).model_info(repo, revision=revision, files_metadata=True)
    except network_errors() as exc:
        raise add_error(exc, repo, ref) from None
    r = _Repo(repo, ref, info)
    if revision and _HEX40.fullmatch(revision.lower()) and revision.lower() != r.commit:
        raise WorkError(f"The Hub answered commit {r.commit} for {repo} at {revision}; refusing a pin it did not "
                        f"confirm.")
    return r


# ---------------------------------------------------------------------------------------------------------------
# what the repository holds

def _weights(r: _Repo) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files (the index's shards, or model.safetensors) and the index's weight map."""
    if r.has(INDEX):
        doc = r.json(INDEX)
        wmap = doc.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise UsageError(f"{INDEX} of {r.where()} has no weight_map; it is not a safetensors index.")
        shards = sorted({str(v) for v in wmap.values()})
        for s in shards:
            if "/" in s or "\\" in s or not s.endswith(".safetensors"):
                raise UsageError(f"{INDEX} of {r.where()} names a shard {s!r} outside the repository folder or "
                                 f"not a .safetensors file; refusing it.")
            try:
                check_relpath(s, f"{INDEX} of {r.where()}: shard")
            except CatalogError as exc:
                raise UsageError(str(exc)) from None
            if not r.has(s):
                raise UsageError(f"{INDEX} of {r.where()} names shard {s}, which the repository does not hold.")
        return shards, {str(k): str(v) for k, v in wmap.items()}
    if r.has(SINGLE):
        return [SINGLE], None
    pickles = sorted(n for n in r.siblings if n.lower().endswith(_PICKLES))
    if pickles:
        raise UsageError(f"{r.where()} holds pickle weights only ({pickles[0]}), which Strata never loads; use a "
                         f"repository with safetensors weights.")
    raise UsageError(f"{r.where()} has no {SINGLE} or {INDEX}; it holds no safetensors weights.")


def _tensors(r: _Repo, shards: list[str], wmap: Mapping[str, str] | None) -> dict[str, tuple[tuple[int, ...], str]]:
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, str] = {}
    for s in shards:
        for name, spec in r.header(s).items():
            if name in found:
                raise UsageError(f"Tensor {name!r} of {r.where()} appears in two shards ({where[name]}, {s}).")
            if wmap is not None and wmap.get(name) not in (None, s):
                raise UsageError(f"Tensor {name!r} of {r.where()} is in {s} but {INDEX} says {wmap[name]}.")
            found[name], where[name] = spec, s
    return found


def _detect(cfg: Mapping[str, Any], r: _Repo, kind: str | None) -> str:
    archs = cfg.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    head = bool(HEAD_ARCHS & {str(a) for a in archs}) or "dflash_config" in cfg
    mt = cfg.get("model_type")
    if not head and mt != "qwen3_moe":
        names = ", ".join(map(str, archs)) or "no architectures"
        raise UsageError(f"{r.where()} is a {mt or 'unknown'} model ({names}); Strata runs qwen3_moe targets with "
                         f"DFlash2 or DFlash heads.")
    detected = "head" if head else "target"
    if kind == "target" and head:
        raise UsageError(f"{r.where()} is a DFlash head, not a target; pass --kind dflash2 or dflash, or leave "
                         f"--kind out.")
    if kind == "head" and not head:
        raise UsageError(f"{r.where()} is a qwen3_moe target, not a DFlash head; add it as a target.")
    if kind in HEAD_KINDS and not head:
        raise UsageError(f"{r.where()} is a qwen3_moe target, not a head; pass --kind target or leave --kind out.")
    return detected


def _config_of(entry: CatalogEntry, store: Store) -> dict[str, Any] | None:
    """An entry's config.json: its verified store copy or bundled folder, else from the Hub (at the pinned commit,
    checked against the pin; an unpinned suggestion at its main branch). None when it cannot be read."""
    try:
        if entry.pinned:
            pulled = verified_entry(entry, store)
            if pulled is not None:
                return json.loads((Path(pulled.path) / "config.json").read_text(encoding="utf-8"))
        if entry.source == "bundled" and entry.repo:
            p = safe_join(bundled_root(), entry.repo, "bundled folder") / "config.json"
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
        if entry.source != "hf" or not entry.repo:
            return None
        if entry.pinned:
            want = entry.file("config.json")
            data = fetch_small(entry.repo, "config.json", entry.revision or "", commit=entry.revision)
            if hashlib.sha256(data).hexdigest() != want.sha256:
                return None
        else:
            data = fetch_small(entry.repo, "config.json", "main")
        doc = json.loads(data.decode("utf-8"))
        return doc if isinstance(doc, dict) else None
    except (StrataError, OSError, ValueError, UnicodeDecodeError, *network_errors()):
        return None


def _target_shape(cfg: Mapping[str, Any]) -> tuple[int, int, int] | None:
    from runtime.models.target_config import Qwen3MoeConfig

    try:
        c = Qwen3MoeConfig.from_dict(dict(cfg))
    except (ConfigError, TypeError, ValueError, KeyError):
        return None
    return c.hidden_size, c.vocab_size, c.num_hidden_layers


def _head_geometry(cfg: Mapping[str, Any]) -> DFlash2Geometry | None:
    try:
        return DFlash2Geometry.from_config(cfg)
    except (ContractError, TypeError, ValueError):
        return None


def _inspect_target(r: _Repo, cfg: dict[str, Any], cat: Catalog, store: Store, found: Found) -> None:
    from runtime.errors import LoadError
    from runtime.loading import check_target_inventory
    from runtime.models.target_config import TargetGeometry

    shards, wmap = _weights(r)
    tensors = _tensors(r, shards, wmap)
    try:
        c, _model = check_target_inventory(cfg, tensors, f"the checkpoint {r.where()}")
    except LoadError as exc:
        raise UsageError(f"{r.where()} cannot be run: {exc}") from None
    mtp = any(n.startswith("mtp.") for n in tensors)
    geo = TargetGeometry.from_config(cfg, has_mtp=mtp)
    params = 0
    for shape, _dtype in tensors.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    dtypes = sorted({d for _s, d in tensors.values()})
    if not r.has("tokenizer.json"):
        raise UsageError(f"{r.where()} has no tokenizer.json, which strata-run needs (the tokenizer is never run "
                         f"from Python code in the repository).")
    names = [n for n in TARGET_FILES if r.has(n) and n != INDEX] + ([INDEX] if wmap is not None else []) + shards
    found.files = [r.pin(n) for n in names]
    found.mtp = mtp
    found.drafters = ["mtp", "dflash2", "none"] if mtp else ["dflash2", "none"]
    found.geometry = {"model_type": "qwen3_moe", "layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                      "vocab_size": c.vocab_size, "experts": c.num_experts, "experts_per_token": c.num_experts_per_tok,
                      "max_position": c.max_position_embeddings, "parameters": params, "dtypes": dtypes,
                      "shards": len(shards), "mtp": mtp, "total_experts": geo.total_experts}
    found.summary = (f"qwen3_moe, {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_experts} experts "
                     f"(top-{c.num_experts_per_tok}), vocab {c.vocab_size}, up to {c.max_position_embeddings} tokens, "
                     f"{_count(params)} parameters ({'/'.join(dtypes)}), {'with' if mtp else 'no'} MTP head")
    _match_heads(found, (c.hidden_size, c.vocab_size, c.num_hidden_layers), cat, store)


def _match_heads(found: Found, shape: tuple[int, int, int], cat: Catalog, store: Store) -> None:
    """The catalog heads that fit a target of this (hidden size, vocabulary, layers)."""
    user = user_catalog_path()
    for h in cat.heads():
        hcfg = _config_of(h, store)
        g = _head_geometry(hcfg) if hcfg else None
        if g is None or pairing_problem(g, *shape) is not None:
            continue
        if found.name in h.fits or Path(h.origin) == user:     # a head of your catalog lists it when this is saved
            found.heads.append(h.name)
        elif h.source == "hf" and h.repo:
            found.notes.append(f"{h.name} fits it by shape, but its entry lists only {', '.join(h.fits)}; "
                               f"`strata-setup models add {h.repo}` pins it for every target it fits.")


# ---------------------------------------------------------------------------------------------------------------
# a GGUF file (llama.cpp's qwen3moe layout) as the target

def gguf_files(r: _Repo) -> list[tuple[str, int]]:
    """The GGUF files at the top of the repository as (name, size) by name: single files, and each complete split
    series as its first part with the size of all its parts (docs/formats.md, "Split GGUF files")."""
    from runtime.formats.gguf_split import part_names, part_of

    out = []
    for n, sib in r.siblings.items():
        if not n.lower().endswith(".gguf") or "/" in n or "\\" in n:
            continue
        p = part_of(n)
        if p is None:
            out.append((n, int(sib.size or 0)))
        elif p[1] == 1 and all(r.has(x) for x in part_names(n)):
            out.append((n, sum(int(r.siblings[x].size or 0) for x in part_names(n))))
    return sorted(out)


def _header_copies(repo: str, pins: list[Any], commit: str, folder: Path, where: str) -> Path:
    """`_header_copy` of each file (every part of a split GGUF) into `folder`; the first one's path."""
    return [_header_copy(repo, p.path, commit, p.size, folder / p.path, where) for p in pins][0]


def _header_copy(repo: str, rel: str, commit: str, size: int, dest: Path, where: str) -> Path:
    """`gguf_remote.read_header` of one file at one commit (Hub errors in one sentence)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    from setup_wizard.gguf_remote import read_header

    url = hf_hub_url(repo, rel, revision=commit, endpoint=hf_endpoint())
    try:
        return read_header(url, size, dest, headers=build_hf_headers(), what=f"{rel} of {where}")
    except network_errors() as exc:
        raise add_error(exc, repo, commit, rel) from None


def _check_gguf_header(local: Path, what: str):
    """A header copy checked as strata-run will load the file (tensor table, types, tokenizer); its config and
    budget geometry. UsageError (exit 2) naming `what` otherwise."""
    from runtime.errors import LoadError
    from runtime.formats.target_gguf import read_geometry
    from runtime.loading_gguf import check_target_gguf, load_tokenizer_gguf

    try:
        cfg, _model, _where = check_target_gguf(local, with_mtp=False)
        geo = read_geometry(local)
        load_tokenizer_gguf(local)
    except (LoadError, ConfigError, ContractError) as exc:
        why = str(exc).removeprefix(f"{local.name}: ").removeprefix(f"{local} ")
        raise UsageError(f"{what} cannot be run: {why}") from None
    return cfg, geo


def _inspect_gguf(r: _Repo, rel: str, cat: Catalog, store: Store, found: Found) -> None:
    import tempfile

    from runtime.formats.gguf_split import part_names

    check_relpath(rel, f"{r.where()}: --file")
    if not rel.lower().endswith(".gguf") or "/" in rel:
        raise UsageError(f"--file {rel} is not a .gguf file at the top of {r.where()}; name one of its GGUF files.")
    if not r.has(rel):
        names = ", ".join(n for n, _ in gguf_files(r)[:6]) or "none"
        raise UsageError(f"{r.where()} has no file {rel}; its GGUF files: {names}.")
    parts = part_names(rel)             # a split file: every part, the target named by the first
    missing = [n for n in parts if not r.has(n)]
    if missing:
        raise UsageError(f"{rel} of {r.where()} is a part of a GGUF file split in {len(parts)}, and the repository "
                         f"lacks {missing[0]}; choose a file whose parts are all there.")
    pins = [r.pin(n) for n in parts]
    what = f"{parts[0]}{f' (and its {len(parts) - 1} other parts)' if len(parts) > 1 else ''} of {r.where()}"
    with tempfile.TemporaryDirectory(prefix="strata-gguf-header-") as tmp:
        local = _header_copies(r.repo, pins, r.commit, Path(tmp), r.where())
        c, geo = _check_gguf_header(local, what)
    found.files = pins
    found.mtp = False
    found.quant = geo.quant
    found.drafters = ["dflash2", "none"]
    found.geometry = {"model_type": "qwen3_moe", "format": "gguf", "quant": geo.quant, "layers": c.num_hidden_layers,
                      "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "experts": c.num_experts,
                      "experts_per_token": c.num_experts_per_tok, "max_position": c.max_position_embeddings,
                      "mtp": False, "total_experts": geo.total_experts}
    found.summary = (f"qwen3moe GGUF ({geo.quant.upper()} experts), {c.num_hidden_layers} layers, hidden "
                     f"{c.hidden_size}, {c.num_experts} experts (top-{c.num_experts_per_tok}), vocab {c.vocab_size}, "
                     f"up to {c.max_position_embeddings} tokens, tokenizer in the file, no MTP head")
    _match_heads(found, (c.hidden_size, c.vocab_size, c.num_hidden_layers), cat, store)


def remote_gguf(entry: CatalogEntry, read: Callable[[Path], Any]) -> Any:
    """`read(path)` of a GGUF target entry's file before it is downloaded: a header copy read from the Hub at the
    pinned commit (`gguf_remote`). Hub errors in one sentence."""
    import tempfile

    if entry.source != "hf" or not entry.repo or not entry.revision or not entry.gguf_file:
        raise UsageError(f"{entry.name} is not a pinned GGUF file on the Hub.")
    with tempfile.TemporaryDirectory(prefix="strata-gguf-header-") as tmp:
        local = _header_copies(entry.repo, list(entry.files), entry.revision, Path(tmp),
                               f"{entry.repo} at {entry.revision}")
        return read(local)


def remote_gguf_geometry(entry: CatalogEntry):
    """The budget geometry of a GGUF target entry not downloaded yet, exact from its header on the Hub (a few MiB
    of ranged reads), so setup can budget it, recommend a context and say whether it fits before the download."""
    from runtime.formats.target_gguf import read_geometry

    return remote_gguf(entry, read_geometry)


def _gguf_target_shape(entry: CatalogEntry, store: Store) -> tuple[int, int, int] | None:
    """(hidden size, vocabulary, layers) of a GGUF target entry: from its verified store copy, else from the file's
    header on the Hub at the pinned commit. None when it cannot be read."""
    from runtime.loading_gguf import read_target_config

    def shape(path: Path) -> tuple[int, int, int]:
        c = read_target_config(path, with_mtp=False)
        return c.hidden_size, c.vocab_size, c.num_hidden_layers

    try:
        pulled = verified_entry(entry, store)
        if pulled is not None:
            return shape(Path(pulled.path) / (entry.gguf_file or ""))
        return remote_gguf(entry, shape)
    except (StrataError, OSError, ValueError, *network_errors()):
        return None


def _inspect_head(r: _Repo, cfg: dict[str, Any], kind: str | None, cat: Catalog, store: Store,
                  found: Found) -> None:
    try:
        geom = DFlash2Geometry.from_config(cfg)
    except ContractError as exc:
        raise UsageError(f"{r.where()} is not a usable DFlash head: {exc}") from None
    shards, wmap = _weights(r)
    tensors = _tensors(r, shards, wmap)
    try:
        layout = check_inventory(tensors, geom, allow_v1=True)
    except ContractError as exc:
        raise UsageError(f"{r.where()} breaks the DFlash2 checkpoint contract: {exc}") from None
    actual = "dflash" if layout == "v1" else "dflash2"
    if kind in HEAD_KINDS and kind != actual:
        what = "a DFlash (v1) head" if actual == "dflash" else "a DFlash2 head (with convolutions and a selector)"
        raise UsageError(f"--kind {kind} does not match {r.where()}, which holds {what}; pass --kind {actual} or "
                         f"leave --kind out.")
    found.kind = actual
    names = ["config.json"] + ([INDEX] if wmap is not None else []) + shards
    found.files = [r.pin(n) for n in names]
    ntl = geom.num_target_layers
    found.geometry = {"layout": layout, "layers": geom.num_layers, "hidden_size": geom.hidden_size,
                      "vocab_size": geom.vocab_size, "block_size": geom.block_size,
                      "target_layer_ids": list(geom.target_layer_ids), "num_target_layers": ntl}
    found.summary = (f"{'DFlash2' if actual == 'dflash2' else 'DFlash (v1)'}, {geom.num_layers} layers, hidden "
                     f"{geom.hidden_size}, vocab {geom.vocab_size}, block {geom.block_size}, taps target layers "
                     f"{list(geom.target_layer_ids)}" + (f" of {ntl}" if ntl else ""))
    for t in cat.targets():
        if t.gguf_file is not None:
            shape = _gguf_target_shape(t, store)
        else:
            tcfg = _config_of(t, store)
            shape = _target_shape(tcfg) if tcfg else None
        if shape is not None and pairing_problem(geom, *shape) is None:
            found.fits.append(t.name)
            if t.pinned:
                found.ready.append(t.name)
    if not found.fits:
        layers = f"{ntl} layers" if ntl else f"at least {max(geom.target_layer_ids) + 1} layers"
        raise UsageError(f"{r.where()} drafts for a target with hidden size {geom.hidden_size}, vocabulary "
                         f"{geom.vocab_size} and {layers}, and no target in your catalog has that shape; add its "
                         f"target first (`strata-setup models add ORG/TARGET`), then this head.")


def _derive_name(repo: str, cat: Catalog, file: str | None = None) -> str:
    """A suggestion's name when the catalog lists this repository unpinned, else the repository's name, lower case
    (a GGUF file: the file's name without .gguf, which carries the quantization: qwen3-30b-a3b-q4_k_m)."""
    if file is not None:
        from runtime.formats.gguf_split import part_of

        stem = part_of(file)[0] if part_of(file) else file[:-len(".gguf")]
        base = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._") or "model"
        return base[:128]
    for e in cat:
        if e.source == "hf" and e.repo and e.repo.lower() == repo.lower() and not e.pinned:
            return e.name
    base = re.sub(r"[^a-z0-9._-]+", "-", repo.split("/", 1)[1].lower()).strip("-._") or "model"
    return base[:128]


def _check_name(name: str, repo: str, given: bool, cat: Catalog, user: Path) -> str | None:
    """Refuse a name another catalog owns; returns what the entry replaces (in words), or None."""
    from setup_wizard.catalog import _NAME

    if not _NAME.fullmatch(name):
        raise UsageError(f"--name {name!r} must be letters, digits, '.', '_' or '-' (up to 128), starting with a "
                         f"letter or digit.")
    old = cat.entries.get(name)
    if old is None:
        return None
    if Path(old.origin) == user:
        return f"your earlier entry for {old.repo} at {(old.revision or '')[:12]}"
    suggestion = not old.pinned and old.source == "hf" and (old.repo or "").lower() == repo.lower()
    if Path(old.origin) == shipped_catalog_path():
        if suggestion:
            return "the shipped suggestion (unpinned) of the same name"
        if old.pinned:
            raise UsageError(f"{name!r} is a pinned entry that ships with strata-setup; pass --name with another "
                             f"name.")
        if given:
            return f"the shipped unpinned entry {name!r}"
        raise UsageError(f"{name!r} is the name of a shipped catalog entry for another model; pass --name with "
                         f"another name.")
    raise UsageError(f"{name!r} is defined in {old.origin} (STRATA_CATALOG), which takes precedence over your "
                     f"catalog; pass --name with another name.")


def inspect_repo(repo: str, *, revision: str | None = None, kind: str | None = None, name: str | None = None,
                 catalog: Catalog | None = None, store: Store | None = None, file: str | None = None,
                 choose_file: Callable[[list[tuple[str, int]]], str | None] | None = None) -> Found:
    """Resolve, read and check a Hub repository without writing anything; UsageError (exit 2) for a repository or
    revision that does not exist or a checkpoint Strata cannot run, WorkError (exit 1) for refused access (the
    HF_TOKEN sentence) or a network failure. `file`: one GGUF file of the repository, pinned as the target; a
    repository of GGUF files without config.json asks `choose_file([(name, size), ...])` (the wizard) when no
    `file` is given, and otherwise says to pass --file."""
    if kind is not None and kind not in (*ADD_KINDS, "head"):        # "head": either head kind (the wizard)
        raise UsageError(f"--kind {kind!r} is not one of {', '.join(ADD_KINDS)}.")
    cat = catalog or load_catalog()
    store = store or Store()
    user = user_catalog_path()
    r = open_repo(repo, revision)
    if file is None and not r.has("config.json"):
        ggufs = gguf_files(r)
        if ggufs and choose_file is not None:
            file = choose_file(ggufs)
            if file is None:
                raise UsageError(f"No GGUF file of {r.where()} was chosen; nothing was added.")
        elif ggufs:     # a llama.cpp repository: one of its files is pinned as the target (docs/commands.md)
            names = [n for n, _ in ggufs]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise UsageError(f"{r.where()} holds GGUF files ({shown}) and no config.json; pass --file with the one "
                             f"to pin as the target, like --file {names[0]}.")
        else:
            raise UsageError(f"{r.where()} has no config.json; it is not a model repository Strata can run.")
    if file is not None:
        if kind is not None and kind != "target":
            raise UsageError(f"--file pins a GGUF file of {r.where()} as a target; drop --kind {kind}.")
        chosen = name or _derive_name(repo, cat, file)
        found = Found(repo=repo, ref=r.ref, revision=r.commit, name=chosen, kind="target", files=[], geometry={},
                      summary="", catalog=user)
        old = cat.entries.get(chosen)
        if old is not None and old.kind != "target":
            raise UsageError(f"{chosen!r} is a {old.kind} entry in the catalog and {file} is a target; pass --name "
                             f"with another name.")
        _inspect_gguf(r, file, cat, store, found)
        return _finish(found, chosen, repo, name, cat, store, user)
    cfg = r.json("config.json")
    detected = _detect(cfg, r, kind)
    chosen = name or _derive_name(repo, cat)
    found = Found(repo=repo, ref=r.ref, revision=r.commit, name=chosen, kind="target", files=[], geometry={},
                  summary="", catalog=user)
    old = cat.entries.get(chosen)
    if old is not None and (old.kind == "target") != (detected == "target"):
        raise UsageError(f"{chosen!r} is a {old.kind} entry in the catalog and {r.where()} is a {detected}; pass "
                         f"--name with another name.")
    if detected == "target":
        _inspect_target(r, cfg, cat, store, found)
    else:
        _inspect_head(r, cfg, kind, cat, store, found)
    return _finish(found, chosen, repo, name, cat, store, user)


def _finish(found: Found, chosen: str, repo: str, name: str | None, cat: Catalog, store: Store, user: Path) -> Found:
    found.replaces = _check_name(chosen, repo, name is not None, cat, user)
    found.free_bytes = store.free_bytes(store.root)
    if found.size > found.free_bytes:
        found.notes.append(f"the download needs {_size(found.size)} but only {_size(found.free_bytes)} is free "
                           f"under {store.root}; free space or set STRATA_HOME to a larger disk before pulling.")
    return found


# ---------------------------------------------------------------------------------------------------------------
# writing the user catalog

def _read_user(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"schema": 1, "entry": []}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CatalogError(f"Your catalog {path} cannot be read ({exc}); fix or remove it.") from None
    if not isinstance(doc.get("entry", []), list):
        raise CatalogError(f"{path}: 'entry' must be an array of tables ([[entry]]).")
    return doc


def save(found: Found) -> Path:
    """Write `found` into the user catalog (replacing an entry of the same name), and list a new target in the
    `fits` of the user catalog's heads that fit it; atomically (the merged catalog is validated first), under the
    catalog's lock."""
    import tomli_w

    path = found.catalog
    home = path.parent
    with writing(home, "your catalog", then="run the command again"), \
            store_lock(home, "catalog", what="your catalog (another models add is writing it)"):
        doc = _read_user(path)
        entries = [dict(e) for e in doc.get("entry", []) if isinstance(e, dict) and e.get("name") != found.name]
        if not found.is_head:
            for e in entries:
                if e.get("name") in found.heads and e.get("kind") in HEAD_KINDS and isinstance(e.get("fits"), list):
                    e["fits"] = sorted(set(e["fits"]) | {found.name})
        entries.append(found.entry_doc())
        text = HEADER + tomli_w.dumps({"schema": 1, "entry": entries})
        with open_dir(home, home) as dfd:
            atomic_write_text(path, text, lambda tmp: _validate(tmp), dir_fd=dfd)
    return path


def _validate(tmp: Path) -> None:
    load_catalog(user=tmp)


def add_model(repo: str, *, revision: str | None = None, name: str | None = None, kind: str | None = None,
              confirm: Callable[[Found], bool] | None = None, show: Callable[[Found], None] | None = None,
              catalog: Catalog | None = None, file: str | None = None,
              choose_file: Callable[[list[tuple[str, int]]], str | None] | None = None) -> tuple[Found, bool]:
    """Inspect `repo` (one GGUF `file` of it, or chosen by `choose_file`) and pin it into the user catalog:
    `show(found)` first, then `confirm(found)` may decline. Returns (what was found, whether it was written). The one
    function `models add` and the wizard call."""
    found = inspect_repo(repo, revision=revision, kind=kind, name=name, catalog=catalog, file=file,
                         choose_file=choose_file)
    if show is not None:
        show(found)
    if confirm is not None and not confirm(found):
        return found, False
    save(found)
    return found, True
