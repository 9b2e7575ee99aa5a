"""The one reader of GGUF files' metadata (docs/formats.md): open a file with gguf-py's reader and turn its fields
into plain Python values. Used by the DFlash2 loader, the converter's read-back check and the setup budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.errors import LoadError

# Provenance keys every GGUF Strata writes (docs/formats.md): the drafter's file and the target's files alike.
KEY_SOURCE_REPO = "strata.source.repo"
KEY_SOURCE_REVISION = "strata.source.revision"
KEY_SOURCE_SHA256 = "strata.source.sha256"
KEY_QUANTIZATION = "strata.quantization"
KEY_CONVERTER_VERSION = "strata.converter_version"


def open_gguf(path: Path, *, error: type[Exception] = LoadError) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped, read-only), or one sentence when the file is not GGUF."""
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises ValueError / struct errors on a damaged file
        raise error(f"{path} is not a readable GGUF file ({e}).") from None


def metadata(reader: Any, prefix: str = "") -> dict[str, Any]:
    """Every key/value field (not the reader's own `GGUF.*` header fields) whose name starts with `prefix`, as
    plain Python values; a field of a type gguf-py cannot decode is left out."""
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or not key.startswith(prefix):
            continue
        try:
            out[key] = f.contents()
        except Exception:  # pragma: no cover - exotic field types
            continue
    return out


def read_metadata(path: Path, prefix: str = "", *, error: type[Exception] = LoadError) -> dict[str, Any]:
    """`metadata` of the file at `path`."""
    return metadata(open_gguf(path, error=error), prefix)
