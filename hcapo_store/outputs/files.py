"""Output files: written whole or not at all, never over an input, with the user's umask."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from hcapo_store.errors import ExportError
from hcapo_store.processes import remove_files_of_dead
from hcapo_store.storage.db import SQLITE_MAGIC

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


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)
WAL_MAGIC = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")
JOURNAL_MAGIC = b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7"


def _not_regular(out: Path) -> str | None:
    """What an existing non-regular file is (followed through links), or None."""
    try:
        mode = os.stat(out).st_mode
    except OSError:
        return None
    return next((kind for test, kind in _KINDS if test(mode)), None)


def _live_side_file(out: Path) -> bool:
    """A SQLite -wal/-shm/-journal file: of an existing SQLite database beside it, or one by its header."""
    for suffix in _SQLITE_SIDE_FILES:
        if out.name.endswith(suffix) and len(out.name) > len(suffix):
            if is_sqlite_file(out.with_name(out.name[: -len(suffix)])):
                return True
            try:
                with open(out, "rb") as f:
                    head = f.read(8)
            except OSError:
                return False
            return head[:4] in WAL_MAGIC or head == JOURNAL_MAGIC
    return False


def check_output(path: Path | str, inputs: Iterable[Path | str] = (), *, directory: bool = False) -> None:
    """Refuse an output path that is an input (also via a symlink or another spelling),
    a SQLite side file of an input or of any SQLite database, an existing SQLite database,
    or anything but a regular file (a device, FIFO or socket; a directory unless
    ``directory``: an output directory, whose files are checked as they are written)."""
    out = Path(path)
    kind = _not_regular(out)
    if kind is not None and not (directory and kind == "a directory"):
        raise ExportError(f"{out} is {kind}, not a regular file; refusing to write there: pick another output path")
    for source in inputs:
        src = Path(source)
        candidates = [src, *(src.with_name(src.name + s) for s in _SQLITE_SIDE_FILES)]
        if any(_same_file(out, c) for c in candidates):
            raise ExportError(
                f"{out} is the database being read ({src}); refusing to overwrite it: pick another output path"
            )
    if out.is_file() and is_sqlite_file(out):
        raise ExportError(f"{out} is a SQLite database; refusing to overwrite it: pick another output path")
    if _live_side_file(out):
        raise ExportError(
            f"{out} is a side file of a SQLite database (its write-ahead log, shared memory or journal); "
            "refusing to overwrite it: pick another output path"
        )


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], *, inputs: Iterable[Path | str] = ()) -> None:
    """Write through ``write(fileobj)`` into a temp file beside ``path``, then rename over it.

    The file gets the mode a plain ``open()`` would give (0666 minus the umask), not
    mkstemp's 0600; an input or a SQLite database at ``path`` is refused.
    """
    inputs = list(inputs)
    check_output(path, inputs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_temps(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        check_output(path, inputs)  # the target may have appeared while we wrote
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _write_error(path, exc) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_error(path: Path, exc: OSError) -> ExportError:
    why = exc.strerror or str(exc)
    hint = (
        "free some space or pick another output path"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT)
        else ("pick another output path")
    )
    return ExportError(f"cannot write {path}: {why}; nothing was written there: {hint}")


def _remove_dead_temps(path: Path) -> None:
    """Temp files of this output left by a writer killed before its rename (its pid is gone)."""
    try:
        names = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]
    except OSError:
        return
    remove_files_of_dead(names, re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[^.]+\.tmp$"))
