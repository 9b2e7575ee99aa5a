"""DFlash2 checkpoint (config.json + BF16 safetensors) -> GGUF v3 (docs/formats.md, "Converted DFlash2 GGUF"), and the converted-artifact cache.
A v1 (plain DFlash) checkpoint converts the same way, to a GGUF without the convolution and selector tensors.

The source is validated before anything is written: config.json through `DFlash2Geometry`, the tensor table (names,
shapes, BF16) through `check_inventory`, and, for a quantized output, every backbone row length against the 32-value
block. The file is then written tensor by tensor (the safetensors data is memory-mapped; one tensor is in memory at
a time) to a temporary name created new (never through a link); every tensor is checked finite as it is read. The
temporary file is read back with `gguf.GGUFReader` (metadata, tensor table, types, sizes) and only then renamed. Any
error removes the temporary file and the folders this conversion created: nothing is left behind. In the store, a
conversion holds its item's lock, and a failed one leaves no folder (docs/store.md).

Backbone matrices (36 for L = 5) are quantized with `runtime.formats.blocks.quantize` (byte-identical to gguf-py); the norm,
convolution and selector tensors keep their BF16 bits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.drafters.dflash2.contract import (
    ALIGNMENT,
    ARCH,
    KEY_ALIGNMENT,
    KEY_ARCHITECTURE,
    KEY_CONVERTER_VERSION,
    KEY_FILE_TYPE,
    KEY_QUANTIZATION,
    KEY_SOURCE_REPO,
    KEY_SOURCE_REVISION,
    KEY_SOURCE_SHA256,
    DFlash2Geometry,
    check_inventory,
    expected_tensors,
    gguf_to_hf,
    hf_to_gguf,
    is_v2_only,
    write_gguf_metadata,
)
from runtime.errors import ContractError, WorkError
from runtime.fileio import CLOEXEC, NOFOLLOW
from runtime.formats import blocks as Q
from runtime.formats.gguf_meta import metadata
from runtime.formats.safetensors_files import TensorRef, checkpoint_files, tensor_refs
from setup_wizard.store import (
    Store,
    StoreError,
    StoreNotWritable,
    check_disk_space,
    manifest_sha256,
    now_iso,
    open_dir,
    regular_file_problem,
    sha256_file,
)
from setup_wizard.store_fs import FULL_ERRNOS, unlink_tmp_files, writing
from setup_wizard.store_locks import item_lock

CONVERTER_VERSION = "1"


class ConvertError(WorkError, OSError):
    """The conversion could not be completed or verified (I/O, read-back mismatch); exit code 1."""


@dataclass(frozen=True)
class Converted:
    path: Path
    sha256: str
    size: int
    quant: str
    source_sha256: str
    converter_version: str = CONVERTER_VERSION
    reused: bool = False


# ---------------------------------------------------------------------------------------------------------------
# reading the source

def locate_source(src: Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """(config.json, safetensors files, weight map) for a folder or a single .safetensors file (config beside it)."""
    src = Path(src)
    if src.is_file():
        if not src.name.endswith(".safetensors"):
            raise ContractError(f"{src} is not a .safetensors file or a checkpoint folder.")
        folder, files, wmap = src.parent, [src], None
    elif src.is_dir():
        folder = src
        files, wmap = checkpoint_files(src, error=ContractError)
    else:
        raise ContractError(f"{src} does not exist; pass a DFlash2 checkpoint folder or its .safetensors file.")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ContractError(f"{folder} has no config.json next to the weights; a DFlash2 checkpoint needs it.")
    return cfg, files, wmap


def source_sha256(files: list[Path]) -> str:
    """sha256 of the source safetensors (for shards: the manifest hash of the shards' hashes)."""
    if len(files) == 1:
        return sha256_file(files[0])
    return manifest_sha256({f.name: {"sha256": sha256_file(f), "size": f.stat().st_size} for f in files})


@dataclass(frozen=True)
class Source:
    config_path: Path
    files: list[Path]
    geom: DFlash2Geometry
    tensors: dict[str, TensorRef]
    kinds: dict[str, str]
    layout: str = "v2"          # "v1": a plain DFlash head (no convolutions, no selector; docs/formats.md)


def validate_source(src: Path, quant: str) -> Source:
    """Everything that can be checked without reading the weights; ContractError (one sentence) otherwise."""
    quant = _check_quant(quant)
    cfg, files, wmap = locate_source(src)
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ContractError(f"{cfg} is not readable JSON ({exc}).") from None
    geom = DFlash2Geometry.from_config(config)
    refs = tensor_refs(files, wmap, error=ContractError)
    layout = check_inventory({n: (r.shape, r.dtype) for n, r in refs.items()}, geom, allow_v1=True)
    kinds = {n: k for n, (_, k) in expected_tensors(geom, v1=layout == "v1").items()}
    if quant != "bf16":
        for name, ref in refs.items():
            if kinds[name] == "backbone" and ref.shape[-1] % Q.BLOCK:
                raise ContractError(f"tensor {name!r} has rows of {ref.shape[-1]} values, not a multiple of 32, so it "
                                    f"cannot be stored as {quant}; convert with --quant bf16.")
    return Source(cfg, files, geom, refs, kinds, layout)


def _check_quant(quant: str) -> str:
    q = str(quant).lower()
    if q not in Q.QTYPES:
        raise ContractError(f"unknown quantization {quant!r}; use one of {', '.join(Q.QTYPES)}.")
    return q


# ---------------------------------------------------------------------------------------------------------------
# writing

def _bf16_bits(ref: TensorRef) -> np.ndarray:
    mm = np.memmap(ref.file, dtype=np.uint16, mode="r", offset=ref.offset, shape=(ref.nbytes // 2,))
    return np.array(mm).reshape(ref.shape)


def _plan(src: Source, quant: str) -> list[tuple[str, str, str, tuple[int, ...], int]]:
    """(hf name, gguf name, qtype, hf shape, nbytes) in file order (sorted by GGUF name for a stable layout)."""
    out = []
    for name, ref in src.tensors.items():
        qt = quant if src.kinds[name] == "backbone" else "bf16"
        rows = int(np.prod(ref.shape[:-1], dtype=np.int64)) if len(ref.shape) > 1 else 1
        nbytes = rows * Q.row_bytes(ref.shape[-1], qt)
        out.append((name, hf_to_gguf(name), qt, ref.shape, nbytes))
    return sorted(out, key=lambda t: _gguf_order(t[1]))


def _gguf_order(gname: str) -> tuple:
    if gname.startswith("blk."):
        i, _, rest = gname[4:].partition(".")
        return (1, int(i), rest)
    return (0 if gname in ("fc.weight", "hidden_norm.weight") else 2, 0, gname)


def write_verified(out: Path, nbytes: int, write: Callable[[Path], None], check: Callable[[Path], list[str]],
                   what: str) -> tuple[str, int]:
    """The one way a converted file comes into being: the missing parent folders made (and removed again on
    failure), a new temporary file beside `out` created without following links, enough free disk for `nbytes`,
    `write(tmp)`, `check(tmp)` reading it back (a problem raises ConvertError), sha256, rename. Any failure removes
    the temporary file and the folders made for it. Returns (sha256, size)."""
    made = _make_parents(out.parent)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _create_new(tmp)
        check_disk_space(Store(out.parent), nbytes + (1 << 20), out.parent, what)
        write(tmp)
        problems = check(tmp)
        if problems:
            raise ConvertError(f"The converted file failed its read-back check ({problems[0]}); nothing was kept.")
        digest = sha256_file(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, out)
    except BaseException:
        _undo(tmp, made)
        raise
    return digest, size


def _cannot_write(folder: Path, exc: OSError) -> Exception:
    why = exc.strerror or str(exc)
    if exc.errno in FULL_ERRNOS:
        return StoreError(f"The disk holding {folder} is full ({why}); free some space or choose another output "
                          f"folder.")
    return StoreNotWritable(f"Cannot create files in {folder} ({why}); choose an output path in a folder you can "
                            f"write.")


def _make_parents(folder: Path) -> list[Path]:
    """Create the missing folders above an output file; returns them (outermost first) so a failure can remove
    exactly these and nothing else."""
    missing = []
    p = Path(folder)
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    made = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
    except OSError as exc:
        _undo(None, made)
        raise _cannot_write(d, exc) from None
    return made


def _create_new(tmp: Path) -> None:
    """Create the temporary output file as a new regular file (a stale one of a dead run with this pid, or a link
    planted in its place, is removed first, never followed)."""
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o666)
    except OSError as exc:
        raise _cannot_write(tmp.parent, exc) from None
    os.close(fd)


def _undo(tmp: Path | None, made: list[Path]) -> None:
    if tmp is not None:
        try:
            tmp.unlink()
        except OSError:
            pass
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            break


def close_quietly(w) -> None:
    """Close a `gguf.GGUFWriter` after a failure (its own error, if any, would hide the first one)."""
    try:
        w.close()
    except Exception:
        pass


def convert_dflash2(src: Path | str, quant: str, out: Path | str, *, source_repo: str = "", source_revision: str = "",
                    source_sha: str | None = None, on_tensor: Callable[[str, int, int], None] | None = None) -> Converted:
    """Convert a DFlash2 checkpoint to GGUF at `out` (atomically). ContractError for a bad source (nothing written),
    ConvertError when writing or the read-back check fails."""
    import gguf

    quant = _check_quant(quant)
    src = Path(src)
    out = Path(out)
    source = validate_source(src, quant)
    sha = source_sha or source_sha256(source.files)
    plan = _plan(source, quant)
    total = sum(nb for *_, nb in plan)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, ARCH)
        try:
            w.add_file_type(Q.FORMATS[quant].file_type)
            w.add_custom_alignment(ALIGNMENT)
            write_gguf_metadata(w, source.geom)
            # add_key_value, not add_string: gguf-py's add_string silently drops an empty value, and docs/formats.md
            # requires every strata.* key (an empty repo/revision means "converted from a local folder")
            add_provenance(w, source_repo, source_revision, sha, quant, CONVERTER_VERSION)
            for _name, gname, qt, shape, nbytes in plan:
                byte_shape = (*shape[:-1], Q.row_bytes(shape[-1], qt))
                w.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), nbytes,
                                  raw_dtype=Q.FORMATS[qt].ggml)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for i, (name, _gname, qt, shape, nbytes) in enumerate(plan):
                bits = _bf16_bits(source.tensors[name])
                if ((bits & 0x7F80) == 0x7F80).any():
                    raise ContractError(f"tensor {name!r} holds NaN or infinite values; the checkpoint is damaged.")
                if qt == "bf16":
                    data = bits.view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)
                else:
                    data = Q.quantize_bf16(bits.reshape(-1, shape[-1]), qt)
                assert data.nbytes == nbytes
                w.write_tensor_data(np.ascontiguousarray(data))
                del bits, data
                if on_tensor:
                    on_tensor(name, i + 1, len(plan))
            w.close()
        except BaseException:
            close_quietly(w)
            raise

    v1 = source.layout == "v1"
    digest, size = write_verified(out, total, write, lambda p: check_gguf(p, source.geom, quant, sha, v1=v1),
                                  f"the converted {quant} file")
    return Converted(out, digest, size, quant, sha)


def add_provenance(w, repo: str, revision: str, sha: str, quant: str, version: str) -> None:
    """The strata.* keys of every converted file (docs/formats.md); written even when empty (gguf-py's add_string
    would drop an empty value)."""
    import gguf

    for key, val in ((KEY_SOURCE_REPO, repo or ""), (KEY_SOURCE_REVISION, revision or ""), (KEY_SOURCE_SHA256, sha),
                     (KEY_QUANTIZATION, quant), (KEY_CONVERTER_VERSION, version)):
        w.add_key_value(key, val, gguf.GGUFValueType.STRING)


# ---------------------------------------------------------------------------------------------------------------
# reading back

def check_gguf(path: Path, geom: DFlash2Geometry | None, quant: str, source_sha: str | None, *,
               v1: bool | None = None) -> list[str]:
    """Problems with a converted file (empty = good): header keys, tensor table (names, types, shapes), sizes.
    With `geom` None the geometry is taken from the file's own metadata; with `v1` None the layout is the file's
    (v1 when it holds no convolution or selector tensor)."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:
        return [f"{path.name} cannot be read as GGUF ({type(exc).__name__}: {exc})"]
    meta = metadata(reader)
    want = {KEY_ARCHITECTURE: ARCH, KEY_QUANTIZATION: quant, KEY_CONVERTER_VERSION: CONVERTER_VERSION,
            KEY_FILE_TYPE: Q.FORMATS[quant].file_type, KEY_ALIGNMENT: ALIGNMENT}
    if source_sha is not None:
        want[KEY_SOURCE_SHA256] = source_sha
    problems = [f"metadata {k} is {meta.get(k)!r}, expected {v!r}" for k, v in want.items() if meta.get(k) != v]
    if problems:
        return problems
    try:
        file_geom = DFlash2Geometry.from_gguf_metadata(meta)
    except ContractError as exc:
        return [str(exc)]
    if geom is not None and (file_geom.hidden_size, file_geom.num_layers, file_geom.vocab_size) != (
            geom.hidden_size, geom.num_layers, geom.vocab_size):
        return ["dflash2 geometry in the file differs from the source config"]
    if v1 is None:
        v1 = not any(_v2_only_gguf(t.name) for t in reader.tensors)
    expected = {hf_to_gguf(n): (shape, kind)
                for n, (shape, kind) in expected_tensors(geom or file_geom, v1=v1).items()}
    size = path.stat().st_size
    seen = set()
    for t in reader.tensors:
        if t.name not in expected:
            problems.append(f"unexpected tensor {t.name}")
            continue
        seen.add(t.name)
        shape, kind = expected[t.name]
        qt = quant if kind == "backbone" else "bf16"
        hf_shape = tuple(int(d) for d in reversed(list(t.shape)))
        if hf_shape != shape:
            problems.append(f"tensor {t.name} has shape {list(hf_shape)}, expected {list(shape)}")
        if int(t.tensor_type) != Q.FORMATS[qt].ggml_type:
            problems.append(f"tensor {t.name} has type {t.tensor_type.name}, expected {qt}")
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if int(t.n_bytes) != rows * Q.row_bytes(shape[-1], qt) or int(t.data_offset) + int(t.n_bytes) > size:
            problems.append(f"tensor {t.name} has the wrong byte size or runs past the end of the file")
    missing = set(expected) - seen
    if missing:
        problems.append(f"missing tensor {sorted(missing)[0]}")
    return problems


def _v2_only_gguf(name: str) -> bool:
    try:
        return is_v2_only(gguf_to_hf(name))
    except ContractError:      # not a contract name: check_gguf reports it as unexpected
        return False


# ---------------------------------------------------------------------------------------------------------------
# the artifact cache

def reuse_verified(store: Store, d: Path, checks: Mapping[str, Callable[[Path], list[str]]]) -> dict | None:
    """The manifest of the converted item in `d` when it can be used as is: verified, exactly the files `checks`
    names, each with its recorded size, passing its read-back check and hashing to its recorded sha256 (the sha256
    the config records must be the file's: a same-size edit passes every other check). None otherwise."""
    m = store.read_manifest(d)
    if not (m and m.get("verified")):
        return None
    files = {str(m.get("file", "model.gguf")): {"sha256": m.get("sha256"), "size": m.get("size")},
             **dict(m.get("extra_files") or {})}
    if set(files) != set(checks):
        return None
    for name, want in files.items():
        p = d / name
        if regular_file_problem(store.root, p) is not None or p.stat().st_size != want.get("size"):
            return None
        if checks[name](p) or sha256_file(p) != want.get("sha256"):
            return None
    return m


def convert_to_store(src: Path | str, quant: str, store: Store | None = None, *, source_name: str = "",
                     source_repo: str = "", source_revision: str = "", source_sha: str | None = None,
                     on_tensor: Callable[[str, int, int], None] | None = None) -> Converted:
    """The converted artifact for (source sha256, quant, converter version): reused from the store after its
    metadata, tensor table, size and sha256 check out, else (re)built. Holds the item's lock while it works (inside
    `store_locks.hold_locks`, until that block ends); a failed conversion leaves no folder. Returns where it is."""
    store = store or Store()
    quant = _check_quant(quant)
    source = validate_source(Path(src), quant)
    sha = source_sha or source_sha256(source.files)
    d = store.converted_dir(sha, quant, CONVERTER_VERSION)
    gg = d / "model.gguf"
    label = f"{source_name or sha[:12]}:{quant}"
    with writing(store.root, f"the converted drafter {label}", then="run the command again"), \
            item_lock(store.root, d, what=f"the converted drafter {label}"):
        unlink_tmp_files(store.root, d)       # a temporary GGUF or manifest an interrupted run left
        v1 = source.layout == "v1"
        m = reuse_verified(store, d, {"model.gguf": lambda p: check_gguf(p, source.geom, quant, sha, v1=v1)})
        if m is not None:
            if source_name and not m.get("source_name"):
                store.write_manifest(d, {**m, "source_name": source_name, "name": label})
            return Converted(gg, m["sha256"], int(m["size"]), quant, sha, CONVERTER_VERSION, reused=True)
        store.invalidate(d)
        try:
            with open_dir(store.root, d):
                pass                          # the item folder, reached and created without links
            res = convert_dflash2(src, quant, gg, source_repo=source_repo, source_revision=source_revision,
                                  source_sha=sha, on_tensor=on_tensor)
        except BaseException:
            store.remove(d)                   # nothing in it is verified: no empty or half folder stays
            raise
        store.write_manifest(d, {"kind": "converted", "file": "model.gguf", "quant": quant, "source_sha256": sha,
                                 "name": label, "source_name": source_name,
                                 "source_repo": source_repo, "source_revision": source_revision,
                                 "source_path": str(Path(src).resolve()), "converter_version": CONVERTER_VERSION,
                                 "sha256": res.sha256, "size": res.size, "mtime_ns": gg.stat().st_mtime_ns,
                                 "verified": True, "verified_at": now_iso()})
    return res


def gguf_tensor_bytes(path: Path) -> dict[str, bytes]:
    """name -> raw bytes of every tensor (tests and debugging)."""
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: bytes(np.asarray(t.data).tobytes()) for t in r.tensors}


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()
