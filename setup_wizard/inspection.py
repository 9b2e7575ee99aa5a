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


def target_geometry(folder: Path) -> TargetGeometry:
    """The budget geometry of a target folder: config.json arithmetic, made exact by the tensor inventory."""
    folder = Path(folder)
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
