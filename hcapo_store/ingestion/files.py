"""The one gate every input file passes before it is read: a regular file, within a bound,
and (for ``follow``) inside the followed folders.

A FIFO would block a read forever, /dev/zero never end, a socket refuse; a link may lead out
of the folders being followed (to /etc/shadow). Each is one ``IngestError`` naming the file,
never a hang, a crash or an unbounded read. The file is opened without blocking and checked
on its open descriptor (``fstat``), so a file swapped for a FIFO between a look and the open
is still refused. ``ingest``'s discovery and ``follow``'s scan both call it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from hcapo_store.errors import IngestError

# Open flags: never wait on a FIFO's writer, never take a terminal as ours.
READ_PIECE = 1 << 20  # bytes asked of the file at once by ``read_regular``
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


def kind_of(mode: int) -> str | None:
    """What a file of ``mode`` is when it is neither a directory nor a regular file."""
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return None
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{kind}, not a regular file: only regular files are read"


def lstat_or_none(path: Path) -> os.stat_result | None:
    """The entry's own status, or None when it cannot be looked at (gone, or no permission:
    ``Path.is_symlink`` raises PermissionError there on Python 3.11)."""
    try:
        return path.lstat()
    except OSError:
        return None


def why_unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read, or None when it can be looked at: a broken link, a link
    loop, no permission, something that is not a regular file or directory."""
    try:
        info = path.stat()
    except OSError as exc:
        return _stat_error(path, exc)
    return kind_of(info.st_mode)


def _stat_error(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link loop"
    own = lstat_or_none(path)
    if own is not None and stat.S_ISLNK(own.st_mode):
        if exc.errno == errno.ENOENT:
            return "a dangling symbolic link (its target does not exist)"
        if exc.errno != errno.EACCES:
            return f"a symbolic link that cannot be followed: {exc.strerror}"
    if exc.errno == errno.EACCES:
        return "cannot read: permission denied (check the file's and its folders' modes)"
    if exc.errno == errno.ENOENT:
        return "no such file or directory"
    return f"cannot read: {exc.strerror}"


def outside(path: Path, roots: Sequence[Path]) -> Path | None:
    """Where ``path`` really leads when that is outside every root (a link out of the
    followed folders), else None. ``roots`` are resolved directories."""
    try:
        real = path.resolve(strict=False)
    except (OSError, RuntimeError):
        return None  # a loop: why_unreadable says so
    if any(real == root or root in real.parents for root in roots):
        return None
    return real


def open_regular(path: Path, limit: int | None, *, roots: Sequence[Path] | None = None) -> BinaryIO:
    """Open ``path`` for reading once it is known to be a regular file of at most ``limit``
    bytes (``None``: read line by line, no whole-file bound) and, with ``roots``, inside one
    of them. Raises ``IngestError`` naming the file; ``FileNotFoundError`` when it is simply
    not there (a missing file is the caller's to judge)."""
    if roots is not None and (real := outside(path, roots)) is not None:
        raise IngestError(
            f"a symbolic link out of the followed folders (to {real}): not read "
            "(follow --follow-links reads such links)",
            path=str(path),
        )
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        own = lstat_or_none(path)
        if own is not None and stat.S_ISLNK(own.st_mode):
            raise IngestError("a dangling symbolic link (its target does not exist)", path=str(path)) from None
        raise
    except OSError as exc:
        raise IngestError(_stat_error(path, exc), path=str(path)) from exc
    try:
        info = os.fstat(fd)
        if (why := kind_of(info.st_mode)) is not None or stat.S_ISDIR(info.st_mode):
            raise IngestError(why or "a directory, not a file", path=str(path))
        if limit is not None and info.st_size > limit:
            raise IngestError(
                f"{info.st_size} bytes: more than the {limit >> 20} MiB this input may have", path=str(path)
            )
        os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return handle


def read_regular(path: Path, limit: int, *, roots: Sequence[Path] | None = None) -> bytes | None:
    """A regular file's bytes (at most ``limit``), or None when it does not exist. The memory
    it takes is the file's size, whatever the bound (2 GiB for a session file)."""
    try:
        handle = open_regular(path, limit, roots=roots)
    except FileNotFoundError:
        return None
    pieces: list[bytes] = []
    size = 0
    try:
        with handle:  # in pieces: a bound costs what is read (read(limit + 1) allocates the bound first)
            while size <= limit and (piece := handle.read(min(READ_PIECE, limit + 1 - size))):
                pieces.append(piece)
                size += len(piece)
    except OSError as exc:
        raise IngestError(f"cannot read: {exc.strerror}", path=str(path)) from exc
    if size > limit:  # it grew while read
        raise IngestError(f"more than the {limit >> 20} MiB this input may have", path=str(path))
    return b"".join(pieces)
