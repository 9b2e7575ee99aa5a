"""The one reader of a checkpoint's safetensors layout (docs/formats.md, "Target folder"): which files hold the
weights (a single `model.safetensors` or the shards an index names), and what each file's header says, checked
against the file's size. No weights are read here.

Callers pass the error class to raise (`LoadError` for a target the runtime loads, `ContractError` for a DFlash2
head, `UsageError` for a folder named on the command line), so one reader serves every context with the right
exit code and one sentence.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import LoadError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 << 20
# bytes per element of the dtypes a checkpoint may hold
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are."""

    file: Path
    dtype: str               # safetensors dtype name: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int              # absolute byte offset in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _safe_shard(folder: Path, name: Any, index: Path, error: type[Exception]) -> Path:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".."):
        raise error(f"{index} names a shard outside the folder ({name!r}).")
    return folder / name


def checkpoint_files(folder: Path, *, error: type[Exception] = LoadError) -> tuple[list[Path], dict[str, str] | None]:
    """(weight files in order, the index's weight map or None): the shards of `model.safetensors.index.json` when
    it exists, else `model.safetensors`."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wmap, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise error(f"{index} is not a valid safetensors index (no weight_map).") from None
        files = [_safe_shard(folder, s, index, error) for s in sorted(set(wmap.values()), key=str)]
        for f in files:
            if not f.is_file():
                raise error(f"shard {f.name} listed in {index.name} is missing from {folder}.")
        return files, {str(k): str(v) for k, v in wmap.items()}
    if (folder / SINGLE).is_file():
        return [folder / SINGLE], None
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        raise error(f"{folder} holds pickle weights only; convert them to safetensors first.")
    raise error(f"{folder} has no {SINGLE} or {INDEX}.")


def read_header(path: Path, *, error: type[Exception] = LoadError) -> tuple[dict[str, Any], int]:
    """(header without `__metadata__`, offset where the data starts)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise error(f"{path} is too small to be a safetensors file.")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise error(f"{path} has a safetensors header length of {n} bytes, which does not fit the file; "
                        f"it is not a valid safetensors file.")
        try:
            hdr = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise error(f"{path} has a safetensors header that is not JSON.") from None
    if not isinstance(hdr, dict):
        raise error(f"{path} has a safetensors header that is not a JSON object.")
    hdr.pop("__metadata__", None)
    return hdr, 8 + n


def tensor_refs(files: list[Path], weight_map: Mapping[str, str] | None = None, *,
                error: type[Exception] = LoadError) -> dict[str, TensorRef]:
    """Every tensor of `files` with its location, checked: well-formed entries, offsets inside the file that match
    the shape (a truncated file is caught here), no name twice, and each name in the shard the index says."""
    refs: dict[str, TensorRef] = {}
    for p in files:
        hdr, start = read_header(p, error=error)
        data_len = p.stat().st_size - start
        for name, info in hdr.items():
            try:
                dtype = str(info["dtype"])
                shape = tuple(int(s) for s in info["shape"])
                b, e = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise error(f"{p}: tensor {name!r} has a malformed header entry.") from None
            ref = TensorRef(p, dtype, shape, start + b, e - b)
            if dtype in DTYPE_BYTES and (e - b != ref.numel * DTYPE_BYTES[dtype] or not 0 <= b <= e <= data_len):
                raise error(f"{p}: tensor {name!r} has data offsets that do not match its shape or the file "
                            f"size (a truncated or corrupt file).")
            if name in refs:
                raise error(f"tensor {name!r} appears in two shards ({refs[name].file.name}, {p.name}).")
            if weight_map is not None and weight_map.get(name) not in (None, p.name):
                raise error(f"tensor {name!r} is in {p.name} but the index says {weight_map[name]}.")
            refs[name] = ref
    return refs


def inventory(folder: Path, *, error: type[Exception] = LoadError) -> dict[str, TensorRef]:
    """`tensor_refs` of a checkpoint folder."""
    files, wmap = checkpoint_files(folder, error=error)
    return tensor_refs(files, wmap, error=error)


# Bit patterns of the non-finite values (NaN, infinity) per float dtype: (element width, mask, value when special).
NONFINITE = {"BF16": (2, 0x7F80, 0x7F80), "F16": (2, 0x7C00, 0x7C00), "F32": (4, 0x7F800000, 0x7F800000),
             "F64": (8, 0x7FF0000000000000, 0x7FF0000000000000), "F8_E4M3": (1, 0x7F, 0x7F),
             "F8_E5M2": (1, 0x7C, 0x7C)}
_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def sha256_checking_finite(path: Path, refs: Mapping[str, TensorRef], *, error: type[Exception] = LoadError,
                           block: int = 1 << 22) -> str:
    """sha256 of a safetensors file, read once from start to end, checking on the way that every float tensor of
    `refs` (this file's, from `tensor_refs`) holds only finite values. Raises `error` naming the first tensor with a
    NaN or an infinity."""
    import hashlib

    import numpy as np

    path = Path(path)
    h = hashlib.sha256()
    ordered = sorted(((r.offset, name, r) for name, r in refs.items() if r.file == path), key=lambda t: t[0])
    with open(path, "rb") as f:
        pos = 0

        def read(n: int) -> bytes:
            nonlocal pos
            data = f.read(n)
            if len(data) != n:
                raise error(f"{path} ended early (a truncated file); download or copy it again.")
            h.update(data)
            pos += n
            return data

        for offset, name, ref in ordered:
            if offset < pos:
                raise error(f"{path}: tensor {name!r} overlaps the tensor before it; the file is corrupt.")
            while pos < offset:
                read(min(block, offset - pos))
            spec = NONFINITE.get(ref.dtype)
            left = ref.nbytes
            step = block if spec is None else max(block - block % spec[0], spec[0])
            while left:
                data = read(min(step, left))
                left -= len(data)
                if spec is not None:
                    width, mask, special = spec
                    bits = np.frombuffer(data, dtype=_UINT[width])
                    if np.any((bits & np.array(mask, dtype=bits.dtype)) == np.array(special, dtype=bits.dtype)):
                        raise error(f"{path}: tensor {name!r} holds NaN or infinite values; the checkpoint is "
                                    f"damaged (export or download it again).")
        while data := f.read(block):
            h.update(data)
    return h.hexdigest()
