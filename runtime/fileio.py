"""File helpers every layer shares: streaming sha256 and the atomic write (temp name, fsync, verify, rename)."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str, verify: Callable[[Path], None] | None = None, *,
                      dir_fd: int | None = None) -> None:
    """Write to a temporary name beside `path`, fsync, run `verify(tmp)` (it raises to refuse), then rename: a
    reader never sees a half-written file, and a failure leaves nothing behind. The temporary file is created new
    (never through a symbolic link) and the rename replaces a link at `path` rather than writing through it. With
    `dir_fd` (an open descriptor of `path`'s folder, reached without following links) every step happens inside
    that folder, whatever its path now resolves to."""
    path = Path(path)
    if dir_fd is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
        try:
            return atomic_write_text(path, text, verify, dir_fd=dfd)
        finally:
            os.close(dfd)
    tmp = f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if verify is not None:
            verify(path.parent / tmp)
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
