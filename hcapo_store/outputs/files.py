"""Output files: written whole or not at all, never over an input, with the user's umask."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from hcapo_store.errors import ExportError

SQLITE_MAGIC = b"SQLite format 3\x00"
_SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def _umask() -> int:
    """The process umask: read from /proc on Linux, else set and restored (no getter exists)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_sqlite_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(path: Path | str, inputs: Iterable[Path | str] = ()) -> None:
    """Refuse an output path that is an input (also via a symlink or another spelling),
    a SQLite side file of an input, or an existing SQLite database."""
    out = Path(path)
    for source in inputs:
        src = Path(source)
        candidates = [src, *(src.with_name(src.name + s) for s in _SQLITE_SIDE_FILES)]
        if any(_same_file(out, c) for c in candidates):
            raise ExportError(
                f"{out} is the database being read ({src}); refusing to overwrite it: pick another output path"
            )
    if out.is_file() and is_sqlite_file(out):
        raise ExportError(f"{out} is a SQLite database; refusing to overwrite it: pick another output path")


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], *, inputs: Iterable[Path | str] = ()) -> None:
    """Write through ``write(fileobj)`` into a temp file beside ``path``, then rename over it.

    The file gets the mode a plain ``open()`` would give (0666 minus the umask), not
    mkstemp's 0600; an input or a SQLite database at ``path`` is refused.
    """
    inputs = list(inputs)
    check_output(path, inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        check_output(path, inputs)  # the target may have appeared while we wrote
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
