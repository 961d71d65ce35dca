"""``follow``'s look at its paths: which episode directories and JSONL files are there, each
with a signature of sizes and modification times (``stat`` only, nothing read), and the few
reads a look needs (is a result.json's reward there yet; a field of a result.json)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hcapo_store.errors import IngestError
from hcapo_store.ingestion.discovery import MAX_JSONL_LINE_BYTES, result_identity
from hcapo_store.ingestion.fields import source_field
from hcapo_store.ingestion.files import lstat_or_none, open_regular, outside, read_regular, why_unreadable
from hcapo_store.ingestion.sources import MAX_RESULT_BYTES, RESULT_FILE, SESSION_FILE

# Per file: (modification time in ns, size, inode). A file replaced by another (a rename into
# place, a folder replaced by a file and back) has another inode even with the same time and size.
Signature = tuple[tuple[int, int, int], ...]


def _stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def rewritten(old: Signature | None, new: Signature) -> bool:
    """A JSONL file's new signature says it was rewritten, not grown: another file at the
    path, or a size that did not grow while the time changed (an edit in place, same length
    or shorter). A grown file that was rewritten (a line 4 bytes longer) is told by the bytes
    before the read offset (``JsonlCursor.tail``)."""
    if old is None or len(old) != 1 or len(new) != 1:
        return False
    (_, old_size, old_ino), (_, size, ino) = old[0], new[0]
    return ino != old_ino or size <= old_size


@dataclass
class Scan:
    """What one look at the paths found (``stat`` only, nothing read)."""

    found: dict[Path, Signature] = field(default_factory=dict)  # episode directories and JSONL files
    refused: dict[Path, str] = field(default_factory=dict)  # entries that are not read, and why


def scan(paths: Sequence[Path], *, follow_links: bool = False) -> Scan:
    """Episode directories and JSONL files under ``paths`` with their signatures; a FIFO,
    device or socket, a broken link, or (unless ``follow_links``) a link out of the paths is
    refused by name. Nothing is opened: a FIFO cannot block a look."""
    out = Scan()
    roots = [Path(p) for p in paths]

    def check_file(path: Path) -> str | None:
        if not follow_links and (real := outside(path, roots)) is not None:
            return f"a symbolic link out of the followed folders (to {real}): not read (--follow-links reads it)"
        own = lstat_or_none(path)
        if own is None:
            return None  # not there (yet)
        return why_unreadable(path)

    def visit(path: Path, *, top: bool) -> None:
        own = lstat_or_none(path)
        if own is None:
            return
        if not stat.S_ISDIR(own.st_mode) and not (top and stat.S_ISLNK(own.st_mode)):
            if path.name.endswith(".jsonl") and path.name != SESSION_FILE:
                why = check_file(path)
                if why is None and not stat.S_ISREG(path.stat().st_mode):
                    why = "not a regular file"
                if why is not None:
                    out.refused[path] = why
                else:
                    out.found[path] = (_stat(path),)
            return
        if not path.is_dir():
            return
        result, session = path / RESULT_FILE, path / SESSION_FILE
        if lstat_or_none(result) is not None or lstat_or_none(session) is not None:
            why = check_file(result) or check_file(session)
            if why is not None:
                out.refused[path] = why
            else:
                out.found[path] = (_stat(result), _stat(session))
            return
        try:
            children = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:  # mode 000: one entry's failure, never the scan's
            out.refused[path] = f"cannot list this folder: {exc.strerror}"
            return
        for child in children:
            try:
                is_dir = child.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir or child.name.endswith(".jsonl"):
                visit(Path(child.path), top=False)

    for p in roots:
        visit(p, top=True)
    return out


def result_state(directory: Path, roots: Sequence[Path] | None) -> tuple[str | None, str | None]:
    """``(None, identity)`` when the episode's result.json has a reward (or an error: the
    collector gave up on it, ingest says so), else ``(why it waits, None)``. ``identity`` is
    the hash of its parsed content (canonical JSON): the same document saved with other
    whitespace or key order has the same one. Read through the one gate (regular, bounded): an
    ``IngestError`` is the episode's failure."""
    data = read_regular(directory / RESULT_FILE, MAX_RESULT_BYTES, roots=roots)
    if data is None:
        return f"no {RESULT_FILE} yet", None
    try:
        result = json.loads(data.decode("utf-8-sig", errors="replace"))
    except (ValueError, RecursionError):
        return f"{RESULT_FILE} is not whole JSON yet", None
    if isinstance(result, dict) and (result.get("episode_reward") is not None or result.get("error")):
        return None, hashlib.sha256(result_identity(data)).hexdigest()
    return "no reward yet", None


def split_location(location: str) -> tuple[Path, int | None]:
    """``file:line`` (a JSONL line) or a path."""
    head, _, tail = location.rpartition(":")
    if head and tail.isdigit() and not Path(location).exists():
        return Path(head), int(tail)
    return Path(location), None


def file_field(location: str, name: str, roots: Sequence[Path] | None) -> str | None:
    """A field of a failed input, when it can be read at all: of an episode directory's
    result.json, or of a JSONL line (``file:line``) that could not be stored (a reward that is
    no number): its batch still counts it, as ``--batch-by parent`` does."""
    path, line = split_location(location)
    try:
        if line is not None:
            data = _jsonl_line(path, line, roots)
        else:
            data = read_regular(path / RESULT_FILE, MAX_RESULT_BYTES, roots=roots) if path.is_dir() else None
    except (IngestError, OSError):
        return None
    return None if data is None else source_field(zlib.compress(data), name)


def _jsonl_line(path: Path, number: int, roots: Sequence[Path] | None) -> bytes | None:
    """Line ``number`` (from 1) of a JSONL file, each line read within the ingest bound."""
    with open_regular(path, None, roots=roots) as handle:
        for _ in range(number):
            raw = handle.readline(MAX_JSONL_LINE_BYTES + 1)
            if not raw or len(raw) > MAX_JSONL_LINE_BYTES:
                return None
    return raw
