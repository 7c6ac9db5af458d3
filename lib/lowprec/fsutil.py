"""Crash-safe file writes: `atomic_write` gives a file whose content is always either the old or the whole new
one, whatever happens to the process (a temporary file beside it, fsynced and renamed into place).
`check_target` tells, before any work, whether a command can write where it was told to."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


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
