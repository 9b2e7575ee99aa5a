"""What a target or head folder holds, read without loading it: the budget geometry (config.json made exact by the
tensor inventory), the runtime files and their hashes, a DFlash2 head's geometry from its config or GGUF metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.errors import ContractError, LoadError, UsageError, WorkError
from runtime.formats.gguf_meta import read_metadata
from runtime.formats.safetensors_files import inventory
from runtime.models.target_config import TargetGeometry
from setup_wizard.config import manifest_sha256, sha256_file
from setup_wizard.services import Artifact, HeadOption

TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "model.safetensors.index.json")


def safetensors_inventory(folder: Path) -> dict[str, int]:
    """Tensor name → element count, from the safetensors headers only (no weights read)."""
    return {name: ref.numel for name, ref in inventory(Path(folder), error=UsageError).items()}


def is_gguf_target(path: Path) -> bool:
    """A target given as one GGUF file (docs/formats.md, "Converted target GGUF") rather than a folder."""
    p = Path(path)
    return p.is_file() and p.suffix.lower() == ".gguf"


def target_geometry(folder: Path) -> TargetGeometry:
    """The budget geometry of a target folder: config.json arithmetic, made exact by the tensor inventory. A GGUF
    target file: exact from its tensor table, stored as the file says."""
    folder = Path(folder)
    if is_gguf_target(folder):
        from runtime.errors import LoadError
        from runtime.formats.target_gguf import read_geometry

        try:
            return read_geometry(folder)
        except LoadError as exc:
            raise UsageError(str(exc)) from None
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"{folder} has no config.json; point --target at a Hugging Face model folder.")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{cfg_path} is not valid JSON; the target folder is damaged.") from None
    return TargetGeometry.from_config(cfg).with_inventory(safetensors_inventory(folder))


def folder_files(folder: Path) -> list[str]:
    """The files of a target folder that matter to the runtime (config, tokenizer, weights)."""
    folder = Path(folder)
    names = [n for n in TARGET_FILES if (folder / n).is_file()]
    names += sorted(p.name for p in folder.glob("*.safetensors"))
    return names


def hash_folder(folder: Path, on_file: Callable[[str], None] | None = None, *, validate: bool = False) -> Artifact:
    """sha256 and size of every runtime file of a local target folder, and the manifest hash over them. With
    `validate`, the folder is first checked as strata-run will load it (tensors and shapes against config.json,
    from the headers), and every weight is checked finite while its file is hashed (one read of each file);
    LoadError (exit code 2, one sentence) before anything is written."""
    from runtime.formats.safetensors_files import sha256_checking_finite
    from runtime.loading import check_target_tensors

    folder = Path(folder)
    by_file: dict[Path, dict] = {}
    if validate:
        _cfg, refs, _model = check_target_tensors(folder)
        for name, ref in refs.items():
            by_file.setdefault(ref.file, {})[name] = ref
    files = {}
    for rel in folder_files(folder):
        if on_file:
            on_file(rel)
        p = folder / rel
        sha = sha256_checking_finite(p, by_file[p], error=LoadError) if p in by_file else sha256_file(p)
        files[rel] = {"sha256": sha, "size": p.stat().st_size}
    return Artifact(path=folder.resolve(), sha256=manifest_sha256(files), files=files,
                    size=sum(f["size"] for f in files.values()))


def target_files(path: Path) -> list[str]:
    """A GGUF target's files (the target file, or every part of a split one, and the MTP file it names), relative to
    its folder."""
    from runtime.formats.gguf_meta import read_metadata
    from runtime.formats.gguf_split import part_names
    from runtime.formats.target_gguf import KEY_MTP_FILE

    p = Path(path)
    names = part_names(p.name)
    mtp = read_metadata(p, "strata.", error=UsageError).get(KEY_MTP_FILE)
    if isinstance(mtp, str) and "/" not in mtp and "\\" not in mtp and (p.parent / mtp).is_file():
        names.append(mtp)
    return names


def hash_target(path: Path, on_file: Callable[[str], None] | None = None) -> Artifact:
    """`hash_folder` for a folder (validated: inventory, shapes and finite weights, checked while hashing); for a GGUF
    target file, its files (with the MTP file) by sha256 and size, relative to its folder, and the target file's own
    sha256 as the target's (it changes with the quantization); for a split one, the manifest hash over its parts."""
    from runtime.formats.gguf_split import part_names

    p = Path(path)
    if not is_gguf_target(p):
        return hash_folder(p, on_file, validate=True)
    files = {}
    for rel in target_files(p):
        if on_file:
            on_file(rel)
        files[rel] = {"sha256": sha256_file(p.parent / rel), "size": (p.parent / rel).stat().st_size}
    parts = part_names(p.name)
    sha = files[p.name]["sha256"] if len(parts) == 1 else manifest_sha256({n: files[n] for n in parts})
    return Artifact(path=p.resolve(), sha256=sha, files=files, size=sum(f["size"] for f in files.values()))


def drafter_geometry(head: HeadOption | Artifact | Path | None) -> DFlash2Geometry | None:
    path = head if isinstance(head, Path) else getattr(head, "local_path", None) or getattr(head, "path", None)
    if path is None:
        return None
    path = Path(path)
    cfg = path / "config.json" if path.is_dir() else path
    if cfg.suffix == ".json" and cfg.is_file():
        try:
            return DFlash2Geometry.from_config(json.loads(cfg.read_text()))
        except (json.JSONDecodeError, ContractError) as exc:
            raise WorkError(f"The DFlash2 config {cfg} cannot be read ({exc}).") from None
    if path.suffix == ".gguf" and path.is_file():
        return DFlash2Geometry.from_gguf_metadata(read_metadata(path, error=WorkError))
    return None
