"""Writing inside the store without following links (docs/store.md, "Links and writes").

Every folder below `$STRATA_HOME` is reached one component at a time with `O_NOFOLLOW | O_DIRECTORY`, and every
file is opened relative to its folder's descriptor with `O_NOFOLLOW`: a symbolic link planted anywhere below the
store root can neither redirect a write nor be marked verified. `$STRATA_HOME` itself may be a link (a store on
another disk); nothing below it may. Errors of the file system become one sentence (read-only store, full disk).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import StrataError, UsageError, WorkError
from runtime.fileio import CLOEXEC, NOFOLLOW

DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC
READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}


class StoreError(WorkError, OSError):
    """A store operation failed (disk, a corrupt manifest, a busy item); one sentence saying what to do."""


class StoreNotWritable(UsageError, OSError):
    """STRATA_HOME (or an output path) cannot be written: read-only or no permission (exit code 2)."""


class LinkRefused(StoreError):
    """A symbolic link where the store expects a folder; the store never writes through links."""


def relative_inside(root: Path, path: Path) -> Path:
    """`path` relative to the store root (as given or resolved), refusing `..` and anything outside."""
    root, path = Path(root), Path(path)
    for base in (root, root.resolve()):
        try:
            rel = path.relative_to(base)
        except ValueError:
            continue
        if ".." in rel.parts:
            break
        return rel
    raise StoreError(f"Refusing {path}: it is outside the store {root}.")


@contextmanager
def open_dir(root: Path, folder: Path, *, create: bool = True) -> Iterator[int]:
    """A descriptor of `folder` (inside `root`), reached without following any link below `root`; the folders are
    created when missing and `create` is set."""
    rel = relative_inside(root, folder)
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
    try:
        where = Path(root)
        for part in rel.parts:
            where = where / part
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = _open_sub(part, fd, where)
            except OSError as exc:
                raise _link_error(exc, where) from None
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def _open_sub(part: str, fd: int, where: Path) -> int:
    try:
        return os.open(part, DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        raise _link_error(exc, where) from None


def _link_error(exc: OSError, where: Path) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return LinkRefused(f"{where} is a symbolic link or a file where the store keeps a folder; the store never "
                           f"writes through links. Remove it (`strata-setup models gc` does) and retry.")
    return exc


def open_file(dir_fd: int, name: str, flags: int, mode: int = 0o666) -> int:
    """Open `name` in the folder `dir_fd` without following a link. A link standing where one of the store's own
    scratch or final files belongs is removed (never followed) and the file is created afresh."""
    flags |= NOFOLLOW | CLOEXEC
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP or not flags & os.O_CREAT:
            raise
        os.unlink(name, dir_fd=dir_fd)      # the link itself, not what it points at
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{name} in the store is not a regular file; remove it and retry.")
    return fd


def lstat_in(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def regular_file_problem(root: Path, path: Path) -> str | None:
    """Why `path` is not a regular file reached inside the store without links (None when it is)."""
    try:
        rel = relative_inside(root, path)
    except StoreError as exc:
        return str(exc)
    where = Path(root)
    for i, part in enumerate(rel.parts):
        where = where / part
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            return f"{rel.as_posix()} is missing"
        except OSError as exc:
            return f"{rel.as_posix()} cannot be read ({exc.strerror or exc})"
        if stat.S_ISLNK(st.st_mode):
            return f"{rel.as_posix()} is a symbolic link, not a file in the store"
        last = i == len(rel.parts) - 1
        if last and not stat.S_ISREG(st.st_mode):
            return f"{rel.as_posix()} is not a regular file"
        if not last and not stat.S_ISDIR(st.st_mode):
            return f"{where} is not a folder"
    return None


def unlink_tmp_files(root: Path, folder: Path, suffixes: tuple[str, ...] = (".tmp",)) -> list[str]:
    """Remove temporary files an interrupted run left in an item folder (the caller holds the item's lock);
    returns their names. Links are removed as links."""
    out: list[str] = []
    try:
        with open_dir(root, folder, create=False) as dfd:
            _sweep(dfd, "", suffixes, out)
    except (FileNotFoundError, LinkRefused):
        pass
    return out


def _sweep(dfd: int, prefix: str, suffixes: tuple[str, ...], out: list[str]) -> None:
    for name in os.listdir(dfd):
        st = lstat_in(dfd, name)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, DIR_FLAGS, dir_fd=dfd)
            try:
                _sweep(sub, f"{prefix}{name}/", suffixes, out)
            finally:
                os.close(sub)
        elif name.endswith(suffixes):
            os.unlink(name, dir_fd=dfd)
            out.append(prefix + name)


def os_error_sentence(exc: OSError, root: Path, what: str,
                      then: str = "run the command again (downloads resume where they stopped)") -> StrataError | None:
    """One sentence for a file-system error met while writing `what` under the store `root`; None when the error
    is not one of these (the caller reports it otherwise). `then` says how the work continues afterwards."""
    if isinstance(exc, StrataError):
        return None
    why = exc.strerror or str(exc)
    if exc.errno in READ_ONLY_ERRNOS:
        return StoreNotWritable(f"Cannot write {what} under {root} ({why}); make that folder writable or set "
                                f"STRATA_HOME to a folder you can write.")
    if exc.errno in FULL_ERRNOS:
        return StoreError(f"The disk holding {root} is full ({why}) while writing {what}; free some space "
                          f"(`strata-setup models gc`) or set STRATA_HOME to a larger disk, then {then}.")
    return None


@contextmanager
def writing(root: Path, what: str,
            then: str = "run the command again (downloads resume where they stopped)") -> Iterator[None]:
    """Turn a read-only store or a full disk met inside the block into one sentence."""
    try:
        yield
    except OSError as exc:
        better = os_error_sentence(exc, root, what, then)
        if better is None:
            raise
        raise better from None
