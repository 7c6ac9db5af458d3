"""Crash-safe file writes: `atomic_write` gives a file whose content is always either the old or the whole new
one, whatever happens to the process (a temporary file beside it, fsynced and renamed into place), and
`remove_temporaries` clears those a killed process left. `lock_folder` holds an OS lock on a folder itself.
`check_target` tells, before any work, whether a command can write where it was told to."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")  # atomic_write's (and mkstemp-named) temporary files


def fsync_dir(path: str | Path) -> None:
    """Make a rename in folder `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open a uniquely named temporary file beside `path` for writing ("w" or "wb"); when the block ends it is
    fsynced and renamed onto `path`. On an error (disk full, an exception in the block) the temporary file is
    removed and `path` keeps its old content; an OSError of the write names `path`."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, mode) as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        message = f"cannot write {path}: {exc.strerror or exc}"
        raise (OSError(exc.errno, message) if exc.errno else OSError(message)) from exc
    fsync_dir(path.parent)


def remove_temporaries(folder: str | Path) -> list[Path]:
    """Remove the temporary files (`TEMPORARY`) a killed writer left in `folder`; call it only while holding
    the folder's lock (`lock_folder`), so that no live writer owns them. Returns what it removed."""
    folder = Path(folder)
    names = folder.iterdir() if folder.is_dir() else ()
    found = [p for p in names if TEMPORARY.fullmatch(p.name) and p.is_file()]
    for path in found:
        path.unlink(missing_ok=True)
    return found


def lock_folder(folder: str | Path, wait: bool = False) -> int | None:
    """An exclusive OS lock (flock) on `folder` itself (created if missing): the descriptor that holds it
    (closing it releases the lock), or None when another descriptor holds one (with `wait`: once it lets
    go). Deleting or replacing a file in the folder cannot defeat it, and the OS drops it when the process
    ends, however it ends."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def folder_locked(folder: str | Path) -> bool:
    """Whether a live process holds `lock_folder`'s lock on `folder`."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def check_target(path: str | Path, what: str, folder: bool = True) -> Path:
    """`path` as a place to write: a folder (`folder`) or a file that exists or can be created there. Raises
    ValueError / OSError naming `what` (e.g. "--out") when it cannot: an empty path, a file where a folder
    must be or the reverse, no write permission, a read-only file system. Creates nothing."""
    if str(path) == "":
        raise ValueError(f"{what} is empty: name a {'folder' if folder else 'file'}")
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        kind = ("a file, not a folder", "a folder, not a file")[path.is_dir()]
        raise (NotADirectoryError if folder else IsADirectoryError)(f"{what} {path} is {kind}")
    parent = next(p for p in (path if folder else path.parent, *path.parents) if p.exists())
    if not parent.is_dir():
        raise NotADirectoryError(f"{what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {path}: {parent} is not writable (no permission, or a read-only disk)")
    return path
