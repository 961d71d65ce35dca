"""Episode identity: a key that does not depend on where the files sit, and a readable name.

Key (``episodes.source_key``; all versions of one episode share it):
- a Pi session with an ``id`` in its header (a UUID): ``pi:<id>``; a changed result.json
  (a corrected reward) or a longer session is a new version of the same episode;
- a Pi session without one (v1): ``pi-sha256:<sha256 of pi_session.jsonl>``: the
  trajectory is the identity, result.json may still change (new version);
- an OpenAI JSONL line with an ``episode_id``: ``jsonl:<file name>#<id>``, the id
  normalised (``1``, ``1.0`` and ``"1"`` are the same id) and scoped by the file's name
  (not its directory, so a moved file keeps its episodes);
- a JSONL line without one: ``jsonl-sha256:<sha256 of the line>`` (its content).

Name: the path relative to the ingest root prefixed by the root's own name
(``pg-01/episode_001``; ``pg-01/eps.jsonl#7``, ``eps.jsonl:3`` for an id-less line 3).
The pipeline keeps one name per key and makes it unique (``episode_keys.name_candidates``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class BadEpisodeId(ValueError):
    """An ``episode_id`` that is neither a string nor an integer."""


def session_key(session_bytes: bytes | None) -> str:
    """The key of a Pi episode directory, from its session file."""
    header_id = _session_header_id(session_bytes or b"")
    if header_id is not None:
        return f"pi:{header_id}"
    return "pi-sha256:" + hashlib.sha256(session_bytes or b"").hexdigest()


def _session_header_id(data: bytes) -> str | None:
    first = next((line for line in data.split(b"\n") if line.strip()), b"")
    try:
        header = json.loads(first)
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("type") != "session":
        return None
    ident = header.get("id")
    if isinstance(ident, str):
        _storable(ident, "the session header's id")
    return ident.strip() if isinstance(ident, str) and ident.strip() else None


def _storable(text: str, what: str) -> None:
    """An identity must be text every database and hash can hold: a lone UTF-16 surrogate
    (``\\ud800`` in the JSON, e.g. an id cut inside an emoji) is refused, naming it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadEpisodeId(
            f"{what} holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x} at character {exc.start}): "
            "not text a database can store; write the id as valid text"
        ) from None


def normalise_id(value: Any) -> str | None:
    """``1``, ``1.0`` and ``"1"`` → ``"1"``; None or "" → None (no id)."""
    if value is None:
        return None
    if isinstance(value, str):
        _storable(value, "episode_id")
        return value.strip() or None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadEpisodeId(f"episode_id must be a string or an integer, got {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadEpisodeId(f"episode_id must be a string or an integer, got {value!r}")
        if value.is_integer():
            return str(int(value))
        return repr(value)
    return str(value)


def jsonl_identity(file_name: str, line: bytes, obj: Any) -> tuple[str, str | None]:
    """(key, normalised id or None) of one JSONL line (``obj`` is the parsed line, or None)."""
    ident = normalise_id(obj.get("episode_id")) if isinstance(obj, dict) else None
    if ident is not None:
        return f"jsonl:{file_name}#{ident}", ident
    return "jsonl-sha256:" + hashlib.sha256(line.strip()).hexdigest(), None


def jsonl_name(file_label: str, ident: str | None, lineno: int) -> str:
    return f"{file_label}#{ident}" if ident is not None else f"{file_label}:{lineno}"


def label(path: Path, root: Path) -> str:
    """``path`` relative to ``root``, prefixed by the root's own name (``pg-01/episode_001``)."""
    parts = (root.name or str(root),) + path.relative_to(root).parts
    return "/".join(parts)


def ancestors(root: Path) -> tuple[str, ...]:
    """Names of the root's parent directories, nearest first (to tell same-named roots apart)."""
    return tuple(p.name for p in root.parents if p.name)


def name_candidates(name: str, prefixes: tuple[str, ...]) -> Iterator[str]:
    """``name``, then with more of the parent directories in front, then ``name~2``, ``name~3``, …"""
    yield name
    for i in range(1, len(prefixes) + 1):
        yield "/".join(reversed(prefixes[:i])) + "/" + name
    n = 2
    while True:
        yield f"{name}~{n}"
        n += 1
