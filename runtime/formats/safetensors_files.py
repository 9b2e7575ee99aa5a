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
