"""Locks over the store (docs/store.md, "Locks"), with `filelock`: one lock per item (a download or a converted
artifact), taken by whoever writes it or is about to use it, and store-wide locks for `gc`/`rm` and for the config
registry. The locks are advisory `flock` locks on files under `$STRATA_HOME/locks/`; the kernel drops them when a
process dies, so a killed run never leaves a stale lock.

A setup holds the locks of every item it uses from the moment it takes them until its config is written and
registered (`hold_locks`), so a `gc` running beside it can see that the items are in use before any config names
them; a second setup that needs the same item waits for the first one.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from setup_wizard.store_fs import StoreError, lstat_in, open_dir, relative_inside

LOCKS = "locks"

_local = threading.local()   # per thread: .held {lock path: FileLock}, .session [lock paths] or None


class ItemBusy(StoreError):
    """Another process (a setup, a pull, a gc) holds the lock this command needs right now."""


def _held() -> dict[str, FileLock]:
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = {}
    return held


def item_key(root: Path, folder: Path) -> str:
    """A lock name for an item folder: its area and a digest of its path inside the store."""
    rel = relative_inside(root, folder).as_posix()
    return f"{rel.split('/', 1)[0]}-{hashlib.sha256(rel.encode()).hexdigest()[:24]}"


def _lock_path(root: Path, key: str) -> Path:
    folder = Path(root) / LOCKS
    with open_dir(root, folder) as dfd:            # the locks folder is a real folder inside the store
        st = lstat_in(dfd, f"{key}.lock")
        if st is not None and stat.S_ISLNK(st.st_mode):
            os.unlink(f"{key}.lock", dir_fd=dfd)   # never lock (and truncate) through a planted link
    return folder / f"{key}.lock"


@contextmanager
def locked(root: Path, key: str, *, what: str, wait: bool = True, keep: bool = True,
           on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock `key` of the store at `root` for the block. Reentrant within a thread. `wait=False` raises
    ItemBusy instead of waiting. Inside `hold_locks`, a lock taken with `keep` stays held until that block ends."""
    got = _acquire(root, key, what=what, wait=wait, on_wait=on_wait)
    if got is None:       # already held by this thread, or a read-only store (no command can change it)
        yield
        return
    path, lock = got
    _held()[path] = lock
    session = getattr(_local, "session", None)
    try:
        yield
    finally:
        if keep and session is not None:
            session.append(path)
        else:
            _held().pop(path, None)
            lock.release()


def _acquire(root: Path, key: str, *, what: str, wait: bool,
             on_wait: Callable[[str], None] | None) -> tuple[str, FileLock] | None:
    """(its path, the acquired lock), or None when this thread holds it already or the store is read-only."""
    try:
        path = str(_lock_path(root, key))
        if path in _held():
            return None
        lock = FileLock(path)
        try:
            lock.acquire(timeout=0)
        except Timeout:            # (a TimeoutError, so an OSError: handled before the read-only case below)
            if not wait:
                raise ItemBusy(f"{what} is in use by another strata-setup command (a setup, pull or gc); run this "
                               f"again when it has finished.") from None
            if on_wait is not None:
                on_wait(f"waiting for another strata-setup command that is using {what}")
            lock.acquire()
        return path, lock
    except OSError as exc:
        if isinstance(exc, Timeout | ItemBusy) or exc.errno != errno.EROFS:
            raise
        return None


def item_lock(root: Path, folder: Path, *, what: str, wait: bool = True,
              on_wait: Callable[[str], None] | None = None):
    """The lock of one store item (a download folder or a converted folder)."""
    return locked(root, item_key(root, folder), what=what, wait=wait, on_wait=on_wait)


def store_lock(root: Path, name: str = "store", *, what: str = "the store", wait: bool = True):
    """A store-wide lock (`store` for gc/rm, `registry` for the config registry); never kept by `hold_locks`."""
    return locked(root, name, what=what, wait=wait, keep=False)


@contextmanager
def hold_locks() -> Iterator[None]:
    """Keep every item lock taken inside the block until the block ends (a setup: until its config is registered)."""
    if getattr(_local, "session", None) is not None:
        yield
        return
    _local.session = []
    try:
        yield
    finally:
        paths, _local.session = _local.session, None
        held = _held()
        for p in reversed(paths):
            lock = held.pop(p, None)
            if lock is not None:
                lock.release()
