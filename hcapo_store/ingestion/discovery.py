"""Discovery: which inputs are under the given paths, each as a lazily parsed ``Source``.

Episode directories (result.json + Pi session JSONL), trajectory roots (``episode_*``
directories and ``*.jsonl`` files) and JSONL files (one episode per line). Every file is
read through files.py's gate (a regular file, within a bound); what cannot be read is one
``IngestError`` naming it, never skipped. A JSONL file can be read from a byte offset
(``JsonlCursor``: ``follow`` reads only what a growing file gained). Parsing is parsing.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

from hcapo_store.canonical import canonical_json
from hcapo_store.errors import IngestError
from hcapo_store.ingestion import episode_keys
from hcapo_store.ingestion.files import kind_of, lstat_or_none, open_regular, read_regular, why_unreadable
from hcapo_store.ingestion.parsing import (
    JSONL_PROBE_LINES,
    RESULT_FILE,
    SESSION_FILE,
    ConvertOptions,
    ParsedEpisode,
    parse_episode_dir,
    parse_jsonl_line,
)


@dataclass(frozen=True)
class Source:
    """A lazily read input: ``load()`` returns a ParsedEpisode or raises Skip/IngestError.

    ``key`` and ``name`` are the episode's identity and readable name (ingestion/episode_keys.py);
    ``path`` is the directory or file it was read from (stored as ``episodes.source_path``),
    ``location`` the same for messages (``path`` or ``path:line``).
    """

    key: str
    name: str
    path: str
    location: str
    content_hash: str
    load: Callable[[], ParsedEpisode]
    prefixes: tuple[str, ...] = ()  # the root's parent directory names, to make the name unique
    # The same content's hash as stores written by earlier versions computed it (an episode
    # directory's result.json by its bytes): a stored version with it is this version too.
    earlier_hash: str | None = None

    def is_stored_as(self, content_hash: str) -> bool:
        return content_hash in (self.content_hash, self.earlier_hash)


def iter_sources(
    paths: list[Path],
    options: ConvertOptions,
    name_root: Path | None = None,
    *,
    cursors: dict[Path, JsonlCursor] | None = None,
    roots: Sequence[Path] | None = None,
    input_format: str | None = None,
) -> Iterator[Source | IngestError]:
    """Yield sources in a stable order; an unreadable path yields its error instead.

    Names are relative to each path, or to ``name_root`` for paths inside it (``follow``
    ingests one changed episode at a time and names it as if its whole tree was given).
    ``cursors``: a JSONL file with a cursor is read from its offset, and the cursor moved past
    its whole lines (``follow``). ``roots``: files whose real place is outside every one of
    these resolved directories are refused, not read (``follow``'s links out of its folders).
    ``input_format`` (one of ``INPUT_FORMATS``): a file given is a JSON array of episodes in
    that format, not JSONL (directories are read as always)."""
    for path in paths:
        path = Path(path)
        if why := why_unreadable(path):
            yield IngestError(why, path=str(path))
            continue
        path = path.resolve()  # names come from real directory names ("." too)
        root = path
        if name_root is not None and name_root.resolve() in path.parents:
            root = name_root.resolve()
        if path.is_file() and input_format is not None:
            yield from _array_sources(path, options, root, input_format, roots)
        elif path.is_file():
            yield from _jsonl_sources(path, options, root, cursors, roots)
        elif _present(path / RESULT_FILE) or _present(path / SESSION_FILE):
            yield _safe_dir_source(path, options, root, roots)
        elif why := _unlistable(path):
            yield IngestError(why, path=str(path))
        else:
            children, jsonl, odd = _children(path)
            for p, why in odd:
                yield IngestError(why, path=str(p))
            if not children and not jsonl and not odd:
                yield NoEpisodesHere(NO_EPISODES + _json_files_hint(path), path=str(path))
            for child in children:
                yield _safe_dir_source(child, options, root, roots)
            for file in jsonl:
                yield from _jsonl_sources(file, options, root, cursors, roots)


class NoEpisodesHere(IngestError):
    """A folder without any input: a failure of the path given, but no episode (a progress
    count of episodes leaves it out)."""


NO_EPISODES = f"no episodes here: expected {RESULT_FILE} + {SESSION_FILE}, episode_* directories, or *.jsonl files"


def _json_files_hint(path: Path) -> str:
    """For a folder without episodes that holds ``*.json`` files (τ-bench writes its results
    as one): how they are read."""
    try:
        with os.scandir(path) as entries:
            names = sorted(e.name for e in entries if e.name.endswith(".json") and e.name != RESULT_FILE)
    except OSError:
        return ""
    if not names:
        return ""
    return f"; a JSON array ({names[0]}{' …' if len(names) > 1 else ''}) is read given as a file with --format tau-bench|openai-list"


def _present(path: Path) -> bool:
    """The entry is there (a link counts, even a broken one: reading it says why), without
    raising where a folder cannot be searched (Path.exists raises PermissionError there)."""
    return lstat_or_none(path) is not None


def _unlistable(path: Path) -> str | None:
    """Why a directory's entries cannot be listed (mode 000), or None."""
    try:
        with os.scandir(path):
            return None
    except OSError as exc:
        return f"cannot list this folder: {exc.strerror}"


def _children(path: Path) -> tuple[list[Path], list[Path], list[tuple[Path, str]]]:
    """A trajectory root's episode directories and JSONL files; what the patterns name but
    cannot be read is a failure of its own (never skipped), each entry judged alone."""
    children, jsonl, odd = [], [], []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        is_episode, is_jsonl = entry.name.startswith("episode_"), entry.name.endswith(".jsonl")
        if not (is_episode or is_jsonl):
            continue
        p = Path(entry.path)
        try:
            mode = p.stat().st_mode
        except OSError:
            odd.append((p, why_unreadable(p) or "cannot read"))
            continue
        if is_episode and stat.S_ISDIR(mode):
            children.append(p)
        elif is_jsonl and stat.S_ISREG(mode):
            jsonl.append(p)
        elif (why := kind_of(mode)) is not None:
            odd.append((p, why))
    return children, jsonl, odd


def count_inputs(paths: list[Path], input_format: str | None = None) -> int:
    """About how many sources ``iter_sources`` will yield (for a progress total): episode
    directories plus non-empty JSONL lines, one for a path it cannot read, none for a folder
    without episodes. Reads JSONL files as bytes only (no parsing), through the same gate; a
    file that is no JSONL counts one (it is refused whole); with ``input_format``, a file
    counts its array's elements."""

    def elements(file: Path) -> int:
        try:
            doc = json.loads(read_regular(file, MAX_ARRAY_BYTES) or b"[]")
        except (OSError, IngestError, ValueError, RecursionError):
            return 1
        return len(doc) if isinstance(doc, list) else 1

    def lines(file: Path) -> int:
        n, last = 0, b"\n"
        try:
            with open_regular(file, None) as f:
                if not_jsonl(f, file) is not None:
                    return 1  # refused as a whole
                f.seek(0)
                while chunk := f.read(1 << 20):
                    n += chunk.count(b"\n")
                    last = chunk[-1:]
        except (OSError, IngestError):
            return 1
        return n + (last != b"\n")

    total = 0
    for path in map(Path, paths):
        if why_unreadable(path):
            total += 1
        elif path.is_file():
            total += lines(path) if input_format is None else elements(path)
        elif _present(path / RESULT_FILE) or _present(path / SESSION_FILE) or _unlistable(path):
            total += 1
        else:
            children, jsonl, odd = _children(path)
            total += len(children) + len(odd) + sum(lines(p) for p in jsonl)
    return total


def _hash(options: ConvertOptions, *parts: bytes) -> str:
    h = hashlib.sha256(json.dumps(options.as_dict(), sort_keys=True).encode())
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


# No input is read without a bound: a result.json is a small document; a session of a 100-step
# episode is a few MB, of the longest agent runs seen a few hundred MB.
MAX_RESULT_BYTES = 64 << 20
MAX_SESSION_BYTES = 2 << 30


def _safe_dir_source(
    directory: Path, options: ConvertOptions, root: Path, roots: Sequence[Path] | None = None
) -> Source | IngestError:
    try:
        return _episode_dir_source(directory, options, root, roots)
    except IngestError as exc:
        return exc


_BOM = b"\xef\xbb\xbf"


def _canonical(data: bytes | None, *, lines: bool, final_newline: bool = False) -> bytes | None:
    """Identity and change detection follow the content, not how an editor saved it: a UTF-8
    BOM and CRLF line ends are dropped; a line-based file keeps at most one final newline
    (``final_newline``: exactly one, for a JSONL line, whose end is no truncation signal; a
    session's missing final newline marks a half-written last line and is kept). A file
    already in that form (what agents write) is unchanged, so its stored keys and hashes stay."""
    if data is None:
        return None
    data = data.removeprefix(_BOM)
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    if lines and data.strip() and (final_newline or data.endswith(b"\n")):
        data = data.rstrip(b"\n") + b"\n"
    return data


def result_identity(data: bytes) -> bytes:
    """What of a ``result.json`` is its episode's identity (the one rule of ``ingest`` and
    ``follow``): its parsed content as canonical JSON (sorted keys, no whitespace), so the same
    document saved again with other whitespace, key order, a BOM or CRLF is the same version,
    and a changed value is a new one. Bytes that are no UTF-8 JSON count as they are (after
    the BOM and CRLF, ``_canonical``): such a file fails to ingest either way."""
    data = _canonical(data, lines=False) or b""
    try:
        parsed = json.loads(data.decode("utf-8"))
        return canonical_json(parsed).encode()
    except (ValueError, RecursionError):  # no JSON (UnicodeDecodeError is a ValueError)
        return data


def _episode_dir_source(
    directory: Path, options: ConvertOptions, root: Path, roots: Sequence[Path] | None = None
) -> Source:
    result_bytes = _canonical(read_regular(directory / RESULT_FILE, MAX_RESULT_BYTES, roots=roots), lines=False)
    session_bytes = _canonical(read_regular(directory / SESSION_FILE, MAX_SESSION_BYTES, roots=roots), lines=True)
    session_part = b"\x00" if session_bytes is None else session_bytes
    digest = _hash(options, b"" if result_bytes is None else result_identity(result_bytes), session_part)
    # Stores written before result.json's identity was its parsed content hold the bytes' hash:
    # an episode whose files did not change is still that version, not a new one.
    by_bytes = _hash(options, result_bytes or b"", session_part)
    try:
        key = episode_keys.session_key(session_bytes)
    except episode_keys.BadEpisodeId as exc:
        raise IngestError(str(exc), path=str(directory / SESSION_FILE), line=1) from None
    return Source(
        key=key,
        name=episode_keys.label(directory, root),
        path=str(directory),
        location=str(directory),
        content_hash=digest,
        earlier_hash=None if by_bytes == digest else by_bytes,
        # a partial of module-level code (not a closure): a worker process can run it
        load=partial(parse_episode_dir, directory, result_bytes, session_bytes, options, digest),
        prefixes=episode_keys.ancestors(root),
    )


@dataclass
class JsonlCursor:
    """How far a growing JSONL file has been read: its whole lines up to ``offset`` (``lines``
    of them). ``tail`` (the bytes just before ``offset``) tells a rewritten file from a longer
    one: a rewritten file is read again from its start. ``waiting_line``: the number of an
    unterminated last line that is no JSON yet (still being written: read again later)."""

    offset: int = 0
    lines: int = 0
    tail: bytes = b""
    waiting_line: int | None = None


_TAIL_BYTES = 64
# One JSONL line is one episode: about a session's size, read whole (a line with no end in
# sight is refused at this bound instead of filling memory).
MAX_JSONL_LINE_BYTES = 512 << 20


@dataclass(frozen=True)
class _Line:
    lineno: int
    offset: int
    key: str
    ident: str | None
    digest: str


def _jsonl_sources(
    path: Path,
    options: ConvertOptions,
    root: Path,
    cursors: dict[Path, JsonlCursor] | None = None,
    roots: Sequence[Path] | None = None,
) -> Iterator[Source | IngestError]:
    """One source per line. Lines of one file that share a key but differ are all refused:
    neither may silently supersede the other (identical repeats are one episode)."""
    try:
        lines = _index_jsonl(path, options, None if cursors is None else cursors.setdefault(path, JsonlCursor()), roots)
    except IngestError as exc:
        yield exc
        return
    except OSError as exc:
        yield IngestError(f"cannot read: {exc.strerror}", path=str(path))
        return
    file_label, prefixes = episode_keys.label(path, root), episode_keys.ancestors(root)
    for entry in _refuse_conflicts(path, lines):
        if isinstance(entry, IngestError):
            yield entry
            continue
        yield Source(
            key=entry.key,
            name=episode_keys.jsonl_name(file_label, entry.ident, entry.lineno),
            path=str(path),
            location=f"{path}:{entry.lineno}",
            content_hash=entry.digest,
            load=partial(_load_jsonl_line, path, entry, options),
            prefixes=prefixes,
        )


def _refuse_conflicts(
    path: Path, lines: list[_Line | IngestError], what: str = "lines", fix: str = "give each its own episode_id"
) -> Iterator[_Line | IngestError]:
    """The lines in order; lines of one file that share a key but differ are all refused:
    neither may silently supersede the other (identical repeats are one episode)."""
    by_key: dict[str, list[_Line]] = {}
    for entry in lines:
        if isinstance(entry, _Line):
            by_key.setdefault(entry.key, []).append(entry)
    for entry in lines:
        if not isinstance(entry, _Line):
            yield entry
            continue
        same = by_key[entry.key]
        if len({e.digest for e in same}) > 1:
            where = ", ".join(str(e.lineno) for e in same)
            yield IngestError(
                f"{what} {where} are the same episode ({entry.key}) with different contents: none is stored; {fix}",
                path=str(path),
                line=entry.lineno,
            )
            continue
        yield entry


def _index_jsonl(
    path: Path, options: ConvertOptions, cursor: JsonlCursor | None = None, roots: Sequence[Path] | None = None
) -> list[_Line | IngestError]:
    """Every non-blank line's key and hash (the lines themselves are read again on load);
    with a ``cursor``, only the lines after it, and the cursor moved past the whole ones."""
    out: list[_Line | IngestError] = []
    with open_regular(path, None, roots=roots) as handle:
        if cursor is not None and cursor.offset and not _continues(handle, cursor):
            cursor.offset, cursor.lines, cursor.tail = 0, 0, b""  # rewritten, not grown: read it all again
        offset = cursor.offset if cursor is not None else 0
        lineno = cursor.lines if cursor is not None else 0
        if cursor is not None:
            cursor.waiting_line = None
        if offset == 0 and (why := not_jsonl(handle, path)) is not None:
            return [IngestError(why, path=str(path))]
        handle.seek(offset)
        while raw := handle.readline(MAX_JSONL_LINE_BYTES + 1):
            lineno += 1
            start, offset = offset, offset + len(raw)
            whole = raw.endswith(b"\n")
            if len(raw) > MAX_JSONL_LINE_BYTES:
                out.append(
                    IngestError(f"a line of more than {MAX_JSONL_LINE_BYTES >> 20} MiB", path=str(path), line=lineno)
                )
                break
            line = _canonical(raw, lines=True, final_newline=True) or b""
            parsed = _json_or_none(line) if line.strip() else None
            if cursor is not None and not whole:
                if parsed is None and line.strip():
                    cursor.waiting_line = lineno  # still being written
                    break
            elif cursor is not None:
                cursor.offset, cursor.lines = offset, lineno
            if not line.strip():
                continue
            try:
                key, ident = episode_keys.jsonl_identity(path.name, line, parsed)
            except episode_keys.BadEpisodeId as exc:
                out.append(IngestError(str(exc), path=str(path), line=lineno))
                continue
            out.append(_Line(lineno, start, key, ident, _hash(options, line)))
        if cursor is not None and cursor.offset:
            handle.seek(max(0, cursor.offset - _TAIL_BYTES))
            cursor.tail = handle.read(min(cursor.offset, _TAIL_BYTES))
    return out


def _continues(handle: IO[bytes], cursor: JsonlCursor) -> bool:
    """The file still holds, just before the cursor, the bytes it held when it was read."""
    n = len(cursor.tail)
    handle.seek(cursor.offset - n)
    return handle.read(n) == cursor.tail


INPUT_FORMATS = ("tau-bench", "openai-list")
_SNIFF_BYTES = 64 << 10
# The entry types of a Pi session file (docs/INGEST.md "Pi session entries"); Pi writes "type" first.
_PI_ENTRY = re.compile(
    rb'\A\{\s*"type"\s*:\s*"(session|message|model_change|thinking_level_change|compaction|branch_summary|'
    rb'custom|custom_message|label|session_info)"'
)


def not_jsonl(handle: IO[bytes], path: Path) -> str | None:
    """Why a file given as JSONL of episodes is not one, in one line saying what to do; None
    when it may be. Reads at most its first 64 KiB (the answer comes at once, however large the
    file): a Pi session file, a JSON array (τ-bench's results, a list of episodes), one
    pretty-printed JSON object, or text whose first lines are no JSON objects."""
    handle.seek(0)
    head = handle.read(_SNIFF_BYTES).removeprefix(_BOM)
    start = head.lstrip()
    first = start.split(b"\n", 1)[0].strip()
    if start.startswith(b"["):
        if b'"traj"' in head and b'"task_id"' in head:
            return (
                "a JSON array of τ-bench results (task_id, reward, traj), not JSONL: ingest it with --format tau-bench"
            )
        what = "a JSON array, not JSONL (one episode object per line)"
        return f"{what}: ingest an array of episodes (messages, reward) with --format openai-list"
    if _PI_ENTRY.match(start):
        beside = path.parent / RESULT_FILE
        if path.name == SESSION_FILE and _present(beside):
            return f"a Pi session file, not JSONL of episodes: ingest its episode directory: hcapo-store ingest {path.parent}"
        return (
            f"a Pi session file, not JSONL of episodes: put it in a directory as {SESSION_FILE} beside a "
            f"{RESULT_FILE} holding episode_reward (docs/INGEST.md), and ingest that directory"
        )
    if first == b"{":
        return "one pretty-printed JSON object, not JSONL: write one episode object per line (e.g. jq -c)"
    handle.seek(0)
    if not _looks_like_jsonl(handle):
        return (
            f"not a JSONL file: none of its first {JSONL_PROBE_LINES} non-empty lines starts "
            "with '{' (one JSON episode object per line expected)"
        )
    return None


# A JSON array is read whole (one document): bounded as a session is.
MAX_ARRAY_BYTES = MAX_SESSION_BYTES


def _array_sources(
    path: Path, options: ConvertOptions, root: Path, input_format: str, roots: Sequence[Path] | None = None
) -> Iterator[Source | IngestError]:
    """One source per element of a JSON array (``--format``). Each element becomes the object a
    JSONL line holds (τ-bench: ``traj`` → ``messages``, ``episode_id`` ``TASK-TRIAL``, every other
    field kept, so ``field:task_id`` finds it); its number in the array (from 1) stands for the
    line. Identity and refusals are a JSONL file's (``jsonl:<file name>#<id>``)."""
    if input_format not in INPUT_FORMATS:
        yield IngestError(f"unknown format {input_format!r}: use one of {', '.join(INPUT_FORMATS)}", path=str(path))
        return
    try:
        data = _canonical(read_regular(path, MAX_ARRAY_BYTES, roots=roots), lines=False) or b""
        doc = json.loads(data)
    except IngestError as exc:
        yield exc
        return
    except (ValueError, RecursionError) as exc:
        yield IngestError(f"--format {input_format}: not a JSON document ({str(exc)[:120]})", path=str(path))
        return
    if not isinstance(doc, list):
        yield IngestError(f"--format {input_format} reads a JSON array, got {type(doc).__name__}", path=str(path))
        return
    entries: list[tuple[_Line, bytes] | IngestError] = []
    for number, element in enumerate(doc, start=1):
        try:
            obj = _tau_bench_episode(element) if input_format == "tau-bench" else element
            if not isinstance(obj, dict):
                raise IngestError(f"element {number} must be an object, got {type(obj).__name__}")
            line = json.dumps(obj).encode("ascii")
            key, ident = episode_keys.jsonl_identity(path.name, line, obj)
        except (IngestError, episode_keys.BadEpisodeId) as exc:
            entries.append(IngestError(str(exc), path=str(path), line=number))
            continue
        entries.append((_Line(number, 0, key, ident, _hash(options, line)), line))
    source_format = input_format.replace("-", "_")
    lines = [e if isinstance(e, IngestError) else e[0] for e in entries]
    payload = {e[0].lineno: e[1] for e in entries if not isinstance(e, IngestError)}
    fix = "give each its own task_id-trial" if input_format == "tau-bench" else "give each its own episode_id"
    for entry in _refuse_conflicts(path, lines, "elements", fix):
        if isinstance(entry, IngestError):
            yield entry
            continue
        yield Source(
            key=entry.key,
            name=episode_keys.jsonl_name(episode_keys.label(path, root), entry.ident, entry.lineno),
            path=str(path),
            location=f"{path}:{entry.lineno}",
            content_hash=entry.digest,
            load=partial(
                parse_jsonl_line, path, entry.lineno, payload[entry.lineno], options, entry.digest, source_format
            ),
            prefixes=episode_keys.ancestors(root),
        )


def _tau_bench_episode(element: Any) -> Any:
    """A τ-bench result (``task_id``, ``trial``, ``reward``, ``info``, ``traj``) as a JSONL episode."""
    if not isinstance(element, dict):
        return element
    if not isinstance(element.get("traj"), list):
        raise IngestError("a τ-bench result has a list 'traj' (its messages)")
    ident = element.get("task_id")
    if ident is not None and element.get("trial") is not None:
        ident = f"{ident}-{element['trial']}"
    episode = {k: v for k, v in element.items() if k != "traj"}
    return {"episode_id": ident, **episode, "messages": element["traj"]}


def _looks_like_jsonl(handle: IO[bytes]) -> bool:
    """One of the first non-empty lines starts with '{' (an empty file has nothing to ingest)."""
    handle.seek(0)  # from the file's start: a rewritten file's check of its tail left it elsewhere
    seen = 0
    for line in handle:
        start = line.lstrip().lstrip(b"\xef\xbb\xbf")
        if not start:
            continue
        if start.startswith(b"{"):
            return True
        seen += 1
        if seen >= JSONL_PROBE_LINES:
            return False
    return seen == 0


def _load_jsonl_line(path: Path, entry: _Line, options: ConvertOptions) -> ParsedEpisode:
    return parse_jsonl_line(path, entry.lineno, _line_at(path, entry, options), options, entry.digest)


def _line_at(path: Path, entry: _Line, options: ConvertOptions) -> bytes:
    try:
        with open_regular(path, None) as handle:
            handle.seek(entry.offset)
            line = _canonical(handle.readline(MAX_JSONL_LINE_BYTES + 1), lines=True, final_newline=True) or b""
    except OSError as exc:
        raise IngestError(f"cannot read: {exc.strerror}", path=str(path), line=entry.lineno) from exc
    if _hash(options, line) != entry.digest:
        raise IngestError("the file changed while it was read: ingest it again", path=str(path), line=entry.lineno)
    return line


def _json_or_none(line: bytes) -> Any:
    """The parsed line, or None when it is not JSON (``load`` then reports it with its line)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None
