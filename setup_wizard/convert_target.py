"""A Qwen3-MoE checkpoint folder -> a GGUF in llama.cpp's own `qwen3moe` layout (docs/formats.md, "Converted target
GGUF"), at BF16, Q8_0 or Q4_0, and the converted-target cache in the store.

What llama.cpp's `convert_hf_to_gguf.py` would write for the same checkpoint: its tensor names, the routed experts
of each layer stacked into `ffn_{gate,up,down}_exps`, norms and the router `ffn_gate_inp` in F32, every other matrix
in the file's type with the bytes `gguf.quants.quantize` gives (runtime/formats/blocks.py is byte-identical and
faster), its metadata keys and its tokenizer metadata (runtime/formats/target_gguf.py, gguf_tokenizer.py). The MTP
head, when the checkpoint has one, goes to `mtp.gguf` beside the target file.

The source is checked before anything is written (config, tensor table, dtypes, row lengths, tokenizer). Writing
streams: the safetensors are memory-mapped and one tensor (one layer's stacked experts of one kind) is in memory at
a time. Each file goes through `write_verified` (temporary name, read back, sha256, rename) and the pair is cached
in the store by (source sha256, quantization, converter version), validated on reuse like the drafter's file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import ConfigError, ContractError, LoadError, UsageError
from runtime.formats import blocks as Q
from runtime.formats import target_gguf as TG
from runtime.formats.gguf_meta import (
    KEY_CONVERTER_VERSION,
    KEY_QUANTIZATION,
    KEY_SOURCE_SHA256,
    metadata,
)
from runtime.formats.gguf_tokenizer import add_tokenizer, vocab_lists
from runtime.formats.safetensors_files import TensorRef, checkpoint_files, tensor_refs
from runtime.models.target_config import Qwen3MoeConfig
from setup_wizard.convert import ConvertError, add_provenance, close_quietly, reuse_verified, write_verified
from setup_wizard.store import Store, manifest_sha256, now_iso, open_dir, sha256_file
from setup_wizard.store_fs import unlink_tmp_files, writing
from setup_wizard.store_locks import item_lock

TARGET_QUANTS = TG.TARGET_QUANTS
CONVERTER_VERSION = "t1"          # "t": the target converter (the drafter's has its own numbering)
TARGET_FILE = "model.gguf"
_FLOAT_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
# the files of a target folder that go into the converted file (and so into its source hash)
SOURCE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "model.safetensors.index.json")


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor to write."""

    gguf: str
    sources: tuple[str, ...]      # checkpoint tensors, in stacking order (one for a plain tensor)
    shape: tuple[int, ...]        # torch order; [E, rows, cols] for a stacked expert tensor
    qtype: str                    # "f32" or a format of the table

    @property
    def nbytes(self) -> int:
        rows = math.prod(self.shape[:-1])
        if self.qtype == "f32":
            return rows * self.shape[-1] * 4
        return rows * Q.row_bytes(self.shape[-1], self.qtype)


@dataclass(frozen=True)
class TargetSource:
    folder: Path
    cfg: Qwen3MoeConfig
    files: list[Path]
    tensors: dict[str, TensorRef]
    target: list[Entry]
    mtp: list[Entry] = field(default_factory=list)


@dataclass(frozen=True)
class ConvertedTarget:
    path: Path
    sha256: str
    size: int
    quant: str
    source_sha256: str
    mtp_path: Path | None = None
    mtp_sha256: str = ""
    mtp_size: int = 0
    converter_version: str = CONVERTER_VERSION
    reused: bool = False

    @property
    def total_size(self) -> int:
        return self.size + self.mtp_size


def check_quant(quant: str) -> str:
    q = str(quant).lower()
    if q not in TARGET_QUANTS:
        raise UsageError(f"unknown target quantization {quant!r}; use one of {', '.join(TARGET_QUANTS)}.")
    return q


def source_sha256(folder: Path, files: list[Path]) -> str:
    """The target's manifest hash (docs/store.md): config, tokenizer and weight files, each by sha256 and size."""
    names = [n for n in SOURCE_FILES if (folder / n).is_file()] + [f.name for f in files]
    return manifest_sha256({n: {"sha256": sha256_file(folder / n), "size": (folder / n).stat().st_size}
                            for n in dict.fromkeys(names)})


# ---------------------------------------------------------------------------------------------------------------
# the plan

def _expected(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, from the model the runtime builds for `cfg` (one definition of the names)."""
    import torch

    from runtime.models.qwen3_moe import Qwen3MoeModel

    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    out = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _entries(expected: dict[str, tuple[int, ...]], cfg: Qwen3MoeConfig, quant: str) -> tuple[list[Entry], list[Entry]]:
    groups: dict[str, dict[int | None, str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    mtp_names: set[str] = set()
    for name, shape in expected.items():
        p = TG.place(name, cfg.num_hidden_layers)
        groups.setdefault(p.gguf, {})[p.expert] = name
        shapes[p.gguf] = shape
        if p.mtp:
            mtp_names.add(p.gguf)
    target: list[Entry] = []
    mtp: list[Entry] = []
    for g, members in groups.items():
        if None in members:
            sources, shape = (members[None],), shapes[g]
        else:
            sources = tuple(members[e] for e in range(len(members)))
            shape = (len(sources), *shapes[g])
        qt = "f32" if TG.stored_as_f32(g, len(shape)) else quant
        (mtp if g in mtp_names else target).append(Entry(g, sources, shape, qt))
    order = _file_order(cfg.num_hidden_layers)
    return sorted(target, key=order), sorted(mtp, key=order)


def _file_order(n_layers: int) -> Callable[[Entry], tuple]:
    """token_embd, then block by block (each block's tensors by name), then output_norm and output."""
    def key(e: Entry) -> tuple:
        if e.gguf.startswith("blk."):
            bid, _, rest = e.gguf[4:].partition(".")
            return (1, int(bid), rest)
        return (0 if e.gguf.startswith("token_embd") else 2, 0, e.gguf)
    return key


def validate_source(src: Path | str, quant: str, *, with_mtp: bool = True) -> TargetSource:
    """Everything that can be checked without reading the weights: UsageError (one sentence) otherwise."""
    quant = check_quant(quant)
    folder = Path(src)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder; pass a Hugging Face qwen3_moe checkpoint folder.")
    cfg_path = folder / "config.json"
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{folder} has no config.json; pass a Hugging Face qwen3_moe checkpoint folder.") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{cfg_path} is not readable JSON ({exc}).") from None
    cfg = Qwen3MoeConfig.from_dict(raw)
    files, wmap = checkpoint_files(folder, error=LoadError)
    refs = tensor_refs(files, wmap, error=LoadError)
    has_mtp = with_mtp and any(n.startswith("mtp.") for n in refs)
    cfg.mtp_layers = 1 if has_mtp else 0
    if has_mtp:
        cfg.mtp_sparse = "mtp.layers.0.mlp.gate.weight" in refs
    TG.check_writable(cfg)
    expected = _expected(cfg)
    missing = [n for n in expected if n not in refs]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"checkpoint in {folder} lacks tensor {missing[0]}{more}; it does not match config.json.")
    extra = [n for n in refs if n not in expected and not (n.startswith("mtp.") and not with_mtp)
             and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if extra:
        raise LoadError(f"checkpoint in {folder} has unexpected tensor {extra[0]}; it does not match config.json.")
    for n, shape in expected.items():
        r = refs[n]
        if r.shape != shape:
            raise LoadError(f"tensor {n} has shape {list(r.shape)}, expected {list(shape)} from config.json.")
        if r.dtype not in _FLOAT_DTYPES:
            raise LoadError(f"tensor {n} is stored as {r.dtype}; the converter reads BF16, F16 or F32 weights.")
    target, mtp = _entries(expected, cfg, quant)
    fmt = Q.FORMATS[quant]
    for e in target + mtp:
        if e.qtype != "f32" and fmt.quantized and e.shape[-1] % fmt.block_values:
            raise ContractError(f"tensor {e.sources[0]!r} has rows of {e.shape[-1]} values, not a multiple of "
                                f"{fmt.block_values}, so it cannot be stored as {quant}; convert with bf16.")
    vocab_lists(folder, cfg.vocab_size)   # the tokenizer can be written (byte-level BPE, a known pre-tokenizer)
    return TargetSource(folder, cfg, files, refs, target, mtp)


# ---------------------------------------------------------------------------------------------------------------
# writing

def _read(ref: TensorRef, name: str) -> np.ndarray:
    """One checkpoint tensor from its memory map (BF16 as uint16 bits), refused when not finite."""
    dt = _FLOAT_DTYPES[ref.dtype]
    a = np.array(np.memmap(ref.file, dtype=dt, mode="r", offset=ref.offset, shape=(ref.numel,))).reshape(ref.shape)
    bad = ((a & 0x7F80) == 0x7F80).any() if dt is np.uint16 else not np.isfinite(a).all()
    if bad:
        raise ContractError(f"tensor {name!r} holds NaN or infinite values; the checkpoint is damaged.")
    return a


def _encode(a: np.ndarray, qtype: str) -> np.ndarray:
    """A checkpoint tensor in the file's encoding, as gguf-py writes it (llama.cpp widens to float32 first; BF16
    widens exactly, so the BF16 paths below give the same bytes)."""
    bf16 = a.dtype == np.uint16
    if qtype == "f32":
        return Q.bf16_bits_to_f32(a) if bf16 else a.astype(np.float32)
    if qtype == "bf16":
        return a.view(np.uint8) if bf16 else Q.f32_to_bf16_bits(a.astype(np.float32)).view(np.uint8)
    if bf16:
        return Q.quantize_bf16(a, qtype)
    return Q.quantize(a.astype(np.float32), qtype)


def _tensor_bytes(src: TargetSource, e: Entry) -> np.ndarray:
    if len(e.sources) == 1 and len(e.shape) == len(src.tensors[e.sources[0]].shape):
        return np.ascontiguousarray(_encode(_read(src.tensors[e.sources[0]], e.sources[0]), e.qtype))
    first = None
    for i, name in enumerate(e.sources):      # one expert at a time into the stacked tensor
        piece = _encode(_read(src.tensors[name], name), e.qtype)
        if first is None:
            first = np.empty((len(e.sources), *piece.shape), piece.dtype)
        first[i] = piece
        del piece
    assert first is not None
    return first


def _add_info(w, e: Entry) -> None:
    import gguf

    if e.qtype == "f32":
        w.add_tensor_info(e.gguf, e.shape, np.dtype(np.float32), e.nbytes, raw_dtype=gguf.GGMLQuantizationType.F32)
    else:
        byte_shape = (*e.shape[:-1], Q.row_bytes(e.shape[-1], e.qtype))
        w.add_tensor_info(e.gguf, byte_shape, np.dtype(np.uint8), e.nbytes, raw_dtype=Q.FORMATS[e.qtype].ggml)


def _writer(src: TargetSource, entries: list[Entry], quant: str, *, mtp: bool, name: str, provenance: tuple,
            on_tensor: Callable[[str, int, int], None] | None, done: list[int], total: int) -> Callable[[Path], None]:
    import gguf

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, TG.ARCH)
        try:
            TG.add_metadata(w, src.cfg, file_type=Q.FORMATS[quant].file_type, name=name, mtp=mtp)
            add_provenance(w, *provenance)
            if not mtp:
                if src.mtp:
                    w.add_key_value(TG.KEY_MTP_FILE, TG.MTP_FILE, gguf.GGUFValueType.STRING)
                add_tokenizer(w, src.folder, src.cfg.vocab_size)
            for e in entries:
                _add_info(w, e)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for e in entries:
                data = _tensor_bytes(src, e)
                assert data.nbytes == e.nbytes, e.gguf
                w.write_tensor_data(data)
                del data
                done[0] += 1
                if on_tensor:
                    on_tensor(e.gguf, done[0], total)
            w.close()
        except BaseException:
            close_quietly(w)
            raise

    return write


def convert_target(src: Path | str, quant: str, out: Path | str, *, name: str = "", source_repo: str = "",
                   source_revision: str = "", source_sha: str | None = None, with_mtp: bool = True,
                   on_tensor: Callable[[str, int, int], None] | None = None) -> ConvertedTarget:
    """Write the target GGUF at `out` (and `mtp.gguf` beside it when the checkpoint has an MTP head), each file
    atomically and read back. UsageError for a bad source (nothing written), ConvertError when writing or a
    read-back check fails."""
    quant = check_quant(quant)
    src_t = validate_source(src, quant, with_mtp=with_mtp)
    out = Path(out)
    sha = source_sha or source_sha256(src_t.folder, src_t.files)
    prov = (source_repo, source_revision, sha, quant, CONVERTER_VERSION)
    label = name or source_repo.rsplit("/", 1)[-1] or src_t.folder.name
    done, total = [0], len(src_t.target) + len(src_t.mtp)
    mtp_out = out.with_name(TG.MTP_FILE)
    if src_t.mtp and mtp_out == out:
        raise UsageError(f"the target file cannot be called {TG.MTP_FILE}; that name is its MTP head's.")
    digest, size = write_verified(
        out, sum(e.nbytes for e in src_t.target) + (8 << 20),
        _writer(src_t, src_t.target, quant, mtp=False, name=label, provenance=prov, on_tensor=on_tensor, done=done,
                total=total),
        lambda p: check_target_gguf(p, src_t, quant, sha, mtp=False), f"the converted {quant} target")
    if not src_t.mtp:
        mtp_out.unlink(missing_ok=True)   # a head left from an earlier conversion would not match
        return ConvertedTarget(out, digest, size, quant, sha)
    mdigest, msize = write_verified(
        mtp_out, sum(e.nbytes for e in src_t.mtp) + (1 << 20),
        _writer(src_t, src_t.mtp, quant, mtp=True, name=label, provenance=prov, on_tensor=on_tensor, done=done,
                total=total),
        lambda p: check_target_gguf(p, src_t, quant, sha, mtp=True), f"the converted {quant} MTP head")
    return ConvertedTarget(out, digest, size, quant, sha, mtp_out, mdigest, msize)


# ---------------------------------------------------------------------------------------------------------------
# reading back

def check_target_gguf(path: Path, src: TargetSource, quant: str, source_sha: str | None, *, mtp: bool) -> list[str]:
    """Problems with a converted target (or MTP) file, empty when good: architecture, provenance, the config read
    back, every tensor's name, type, shape and byte size."""
    import gguf

    from runtime.formats.gguf_meta import open_gguf

    try:
        reader = open_gguf(Path(path), error=ConvertError)
    except ConvertError as exc:
        return [str(exc)]
    meta = metadata(reader)
    want = {gguf.Keys.General.ARCHITECTURE: TG.ARCH, KEY_QUANTIZATION: quant,
            KEY_CONVERTER_VERSION: CONVERTER_VERSION, gguf.Keys.General.FILE_TYPE: Q.FORMATS[quant].file_type}
    if source_sha is not None:
        want[KEY_SOURCE_SHA256] = source_sha
    if not mtp:
        want[TG.KEY_MTP_FILE] = TG.MTP_FILE if src.mtp else None
    problems = [f"metadata {k} is {meta.get(k)!r}, expected {v!r}" for k, v in want.items() if meta.get(k) != v]
    entries = {e.gguf: e for e in (src.mtp if mtp else src.target)}
    shapes = {t.name: tuple(int(d) for d in reversed(list(t.shape))) for t in reader.tensors}
    if not mtp:
        try:
            cfg = TG.config_from_metadata(meta, shapes, source=Path(path).name)
        except (LoadError, ConfigError) as exc:
            return problems + [str(exc)]
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "tie_word_embeddings", "rope_type"):
            if getattr(cfg, f) != getattr(src.cfg, f):
                problems.append(f"{f} reads back as {getattr(cfg, f)!r}, expected {getattr(src.cfg, f)!r}")
    size = Path(path).stat().st_size
    seen = set()
    for t in reader.tensors:
        e = entries.get(t.name)
        if e is None:
            problems.append(f"unexpected tensor {t.name}")
            continue
        seen.add(t.name)
        want_type = gguf.GGMLQuantizationType.F32 if e.qtype == "f32" else Q.FORMATS[e.qtype].ggml
        if shapes[t.name] != e.shape:
            problems.append(f"tensor {t.name} has shape {list(shapes[t.name])}, expected {list(e.shape)}")
        if int(t.tensor_type) != int(want_type):
            problems.append(f"tensor {t.name} has type {t.tensor_type.name}, expected {want_type.name}")
        if int(t.n_bytes) != e.nbytes or int(t.data_offset) + int(t.n_bytes) > size:
            problems.append(f"tensor {t.name} has the wrong byte size or runs past the end of the file")
    missing = set(entries) - seen
    if missing:
        problems.append(f"missing tensor {sorted(missing)[0]}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# the store's cache

def convert_target_to_store(src: Path | str, quant: str, store: Store | None = None, *, source_name: str = "",
                            source_repo: str = "", source_revision: str = "", source_sha: str | None = None,
                            on_tensor: Callable[[str, int, int], None] | None = None) -> ConvertedTarget:
    """The converted target for (source sha256, quant, converter version): reused after each of its files passes
    its read-back check, size and sha256, else (re)built. The manifest lists `mtp.gguf` in `extra_files`."""
    store = store or Store()
    quant = check_quant(quant)
    src_t = validate_source(src, quant)
    sha = source_sha or source_sha256(src_t.folder, src_t.files)
    d = store.converted_dir(sha, quant, CONVERTER_VERSION)
    gg = d / TARGET_FILE
    checks = {TARGET_FILE: lambda p: check_target_gguf(p, src_t, quant, sha, mtp=False)}
    if src_t.mtp:
        checks[TG.MTP_FILE] = lambda p: check_target_gguf(p, src_t, quant, sha, mtp=True)
    label = f"{source_name or sha[:12]}:{quant}"
    with writing(store.root, f"the converted target {label}", then="run the command again"), \
            item_lock(store.root, d, what=f"the converted target {label}"):
        unlink_tmp_files(store.root, d)       # temporary files an interrupted run left
        m = reuse_verified(store, d, checks)
        if m is not None:
            extra = (m.get("extra_files") or {}).get(TG.MTP_FILE)
            return ConvertedTarget(gg, m["sha256"], int(m["size"]), quant, sha,
                                   d / TG.MTP_FILE if extra else None, extra["sha256"] if extra else "",
                                   int(extra["size"]) if extra else 0, CONVERTER_VERSION, reused=True)
        store.invalidate(d)
        try:
            with open_dir(store.root, d):
                pass                          # the item folder, reached and created without links
            res = convert_target(src, quant, gg, name=source_name, source_repo=source_repo,
                                 source_revision=source_revision, source_sha=sha, on_tensor=on_tensor)
        except BaseException:
            store.remove(d)                   # nothing in it is verified: no empty or half folder stays
            raise
        doc = {"kind": "converted", "role": "target", "file": TARGET_FILE, "quant": quant, "source_sha256": sha,
               "name": label, "source_name": source_name, "source_repo": source_repo,
               "source_revision": source_revision, "source_path": str(Path(src).resolve()),
               "converter_version": CONVERTER_VERSION, "sha256": res.sha256, "size": res.size,
               "mtime_ns": gg.stat().st_mtime_ns, "verified": True, "verified_at": now_iso()}
        if res.mtp_path is not None:
            doc["extra_files"] = {TG.MTP_FILE: {"sha256": res.mtp_sha256, "size": res.mtp_size}}
        store.write_manifest(d, doc)
    return res
