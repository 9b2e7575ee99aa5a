"""Corpus and tokenizer for strata-nano: the Python standard library's own source code.

The corpus is the `.py` files of the standard library of the interpreter that runs this module (site-packages
excluded), in sorted order of their relative paths, one document per file, separated by `<|endoftext|>`. A fixed
set of modules (and their tests) is held out for evaluation and never trained on. The manifest records the Python
version and a sha256 of the sorted file list, so a rebuild can be checked against the one the pack was trained on.

Built here (CPU, about a minute) and carried to the GPU machine as `training/data/` (gitignored): the GPU
machine's interpreter is a different Python, and the pack must be trained on the corpus the tokenizer was fit on.

    python -m training.corpus --out training/data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.tok import EOS, train_tokenizer

# Modules never trained on: the module (file or package) and its tests under test/.
HELD_OUT = (
    "argparse", "csv", "difflib", "fractions", "heapq", "json", "shlex", "statistics", "string", "textwrap",
)


@dataclass
class Corpus:
    train_files: list[tuple[str, str]]  # (relative path, text)
    eval_files: list[tuple[str, str]]
    manifest: dict


def is_held_out(rel: str) -> bool:
    """True for the held-out modules and their test files (`test/test_NAME.py`, `test/test_NAME/...`)."""
    for m in HELD_OUT:
        for stem in (m, f"test/test_{m}"):
            if rel == f"{stem}.py" or rel.startswith(f"{stem}/"):
                return True
    return False


def collect(stdlib: Path | None = None) -> Corpus:
    """Read every stdlib `.py` file that decodes as UTF-8 and split it into train and held-out files."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )
    train, held, skipped = [], [], []
    for rel in rels:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if "\x00" in text or not text.strip():
            skipped.append(rel)
            continue
        (held if is_held_out(rel) else train).append((rel, text))
    listing = "\n".join(rels).encode()
    content = hashlib.sha256()
    for rel, text in train + held:
        content.update(rel.encode() + b"\0" + text.encode() + b"\0")
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "files": len(rels),
        "file_list_sha256": hashlib.sha256(listing).hexdigest(),
        "content_sha256": content.hexdigest(),
        "train_files": len(train),
        "eval_files": len(held),
        "skipped_files": skipped,
        "held_out_modules": list(HELD_OUT),
        "train_chars": sum(len(t) for _, t in train),
        "eval_chars": sum(len(t) for _, t in held),
    }
    return Corpus(train, held, manifest)


def encode_documents(tokenizer, files: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the files joined by EOS (uint16) and the start offset of each document."""
    encs = tokenizer.encode_batch([t for _, t in files], add_special_tokens=False)
    pieces, starts, n = [], [], 0
    for e in encs:
        starts.append(n)
        ids = np.asarray(e.ids + [EOS], dtype=np.uint16)
        pieces.append(ids)
        n += len(ids)
    return np.concatenate(pieces), np.asarray(starts, dtype=np.int64)


def build(out: Path, vocab_size: int = 4096, stdlib: Path | None = None, max_files: int | None = None) -> dict:
    """Write `tokenizer.json`, `corpus.npz` (train/eval token ids) and `manifest.json` under `out`."""
    t0 = time.time()
    corpus = collect(stdlib)
    if max_files is not None:  # toy builds (tests): a small deterministic slice
        corpus.train_files = corpus.train_files[:max_files]
        corpus.eval_files = corpus.eval_files[: max(1, max_files // 8)]
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer((t for _, t in corpus.train_files), vocab_size)
    train_ids, _ = encode_documents(tok, corpus.train_files)
    eval_ids, eval_starts = encode_documents(tok, corpus.eval_files)
    tmp = out / "corpus.tmp.npz"
    np.savez_compressed(tmp, train=train_ids, eval=eval_ids, eval_starts=eval_starts)
    tmp.replace(out / "corpus.npz")
    tok.save(str(out / "tokenizer.json"))
    manifest = dict(corpus.manifest)
    manifest.update(
        vocab_size=tok.get_vocab_size(),
        train_tokens=int(train_ids.size),
        eval_tokens=int(eval_ids.size),
        eval_documents=[rel for rel, _ in corpus.eval_files],
        tokenizer_sha256=hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        build_s=round(time.time() - t0, 1),
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load(data_dir: Path) -> dict[str, np.ndarray]:
    """The token arrays written by `build` (int64)."""
    with np.load(data_dir / "corpus.npz") as z:
        return {k: z[k].astype(np.int64) for k in z.files}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("training/data"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-files", type=int, default=None, help="toy builds: only the first N training files")
    args = ap.parse_args(argv)
    m = build(args.out, args.vocab_size, max_files=args.max_files)
    keys = ("python", "files", "file_list_sha256", "train_tokens", "eval_tokens", "build_s")
    print(json.dumps({k: m[k] for k in keys}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
