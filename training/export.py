"""Write trained modules as the shipped Hugging Face style folders (BF16 safetensors + config + tokenizer)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from torch import nn

from training.common import save_bf16, write_json
from training.tok import write_hf_files


def export_target(model: nn.Module, folder: Path, config: dict, tokenizer_json: Path) -> Path:
    """`config.json`, `model.safetensors` (target + `mtp.*`, BF16), tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_bf16(state, folder / "model.safetensors")
    write_json(folder / "config.json", config)
    write_hf_files(folder, tokenizer_json, config["max_position_embeddings"])
    return folder


def export_drafter(state: dict, folder: Path, config: dict) -> Path:
    """`config.json` and `model.safetensors` (the 81-tensor DFlash2 contract, BF16)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_bf16(state, folder / "model.safetensors")
    write_json(folder / "config.json", config)
    return folder


def tar_folder(folder: Path, dest: Path) -> Path:
    """An uncompressed tar of the folder's files (flat, sorted, fixed mtimes) written atomically."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for f in sorted(folder.iterdir()):
            if not f.is_file() or f.name.endswith(".tmp"):
                continue
            info = tarfile.TarInfo(f"{folder.name}/{f.name}")
            data = f.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tf.addfile(info, io.BytesIO(data))
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(dest)
    return dest


def untar_safely(archive: Path, dest: Path) -> list[Path]:
    """Extract plain files of a tar written by `tar_folder` (one folder level, no links, no '..')."""
    out = []
    with tarfile.open(archive) as tf:
        for m in tf.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) != 2 or any(p in ("..", "") or p.startswith("/") for p in parts):
                raise ValueError(f"{archive} holds an unexpected member {m.name!r}; refusing to extract it.")
            target = dest / parts[0] / parts[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tf.extractfile(m).read())
            out.append(target)
    return out
