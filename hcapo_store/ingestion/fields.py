"""Per-episode values read back from what was ingested: a top-level field of the episode's
result.json (or of its JSONL line, or its element of a ``--format`` array), or an ingest tag.

One lookup for every grouping by episode: ``follow --batch-by field:NAME`` and
``credits compute`` / ``diagnose`` / ``export dataset --group-by field:NAME|tag:KEY|KEY``.
Values are read from the stored raw source (lossless: what the file said).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence

from sqlalchemy import Connection, text

from hcapo_store.canonical import canonical_json
from hcapo_store.errors import UsageError
from hcapo_store.ingestion.parsing import RESULT_FILE

_CHUNK = 500


def source_field(raw: bytes, name: str) -> str | None:
    """A top-level field of an episode's result.json (episode directories) or JSONL line, from
    its stored (zlib-compressed) raw source; an object or a list as canonical JSON."""
    try:
        result = _leading_result(raw)
        if result is not None:
            doc = json.loads(result)
        else:
            doc = json.loads(zlib.decompress(raw))
            if isinstance(doc, dict) and RESULT_FILE in doc and isinstance(doc[RESULT_FILE], str):
                doc = json.loads(doc[RESULT_FILE])
    except (zlib.error, ValueError, RecursionError):
        return None
    value = doc.get(name) if isinstance(doc, dict) else None
    if value is None or isinstance(value, (dict, list)):
        return None if value is None else canonical_json(value)
    return str(value)


# An episode directory's raw source is ASCII JSON that opens with its result.json as a string
# (parsing.py: {"result.json": "...", "pi_session.jsonl": "..."}): that string is read from the
# first kilobytes, not after decompressing and parsing a session of many megabytes.
_RESULT_PREFIX = json.dumps({RESULT_FILE: ""})[:-3]  # '{"result.json": '
_PIECE = 1 << 16


def _leading_result(raw: bytes) -> str | None:
    """The result.json text at the head of a directory episode's raw source; None for any
    other source (a JSONL line), which is read whole."""
    inflate = zlib.decompressobj()
    head = inflate.decompress(raw, _PIECE)
    if not head.startswith(_RESULT_PREFIX.encode()):
        return None
    decoder = json.JSONDecoder()
    while True:
        try:
            value, _ = decoder.raw_decode(head.decode("ascii"), len(_RESULT_PREFIX))
            return value if isinstance(value, str) else None
        except ValueError:
            if not inflate.unconsumed_tail:
                return None  # no whole string: the whole-document path says what it is
            head += inflate.decompress(inflate.unconsumed_tail, _PIECE)


def parse_group_by(value: str) -> tuple[str, str]:
    """``field:NAME`` → ("field", NAME); ``tag:KEY`` or a bare ``KEY`` → ("tag", KEY)."""
    kind, sep, name = value.partition(":")
    if sep and kind in ("field", "tag"):
        if not name.strip():
            raise UsageError(f"--group-by {value!r}: name the {kind} after '{kind}:'")
        return kind, name
    return "tag", value


def kind(group_by: str) -> str:
    """``tag`` or ``field``: what an episode without a value lacks (for messages)."""
    return parse_group_by(group_by)[0]


def group_values(conn: Connection, episode_ids: Sequence[int], group_by: str) -> list[str | None]:
    """Each episode's value of ``group_by`` (``field:NAME``, ``tag:KEY`` or a tag ``KEY``), in the
    order given; None where it has none."""
    kind, name = parse_group_by(group_by)
    ids = [int(i) for i in episode_ids]
    if kind == "tag":
        tags: dict[int, str] = dict(
            conn.execute(text("SELECT episode_id, value FROM tags WHERE key = :k"), {"k": name}).all()
        )
        return [tags.get(i) for i in ids]
    values: dict[int, str | None] = {}
    unique = sorted(set(ids))
    for start in range(0, len(unique), _CHUNK):
        marks = ", ".join(str(i) for i in unique[start : start + _CHUNK])  # integers, not user text
        for episode_id, raw in conn.execute(text(f"SELECT id, raw_source FROM episodes WHERE id IN ({marks})")):
            values[int(episode_id)] = source_field(bytes(raw) if raw is not None else b"", name)
    return [values.get(i) for i in ids]


def known_keys(conn: Connection, group_by: str) -> str:
    """For a refusal: the tags there are (a field's names are the file's own: none listed)."""
    if parse_group_by(group_by)[0] == "field":
        return "a top-level field of result.json or of the JSONL line"
    known = [r[0] for r in conn.execute(text("SELECT DISTINCT key FROM tags ORDER BY key"))]
    return f"tags: {', '.join(known) or 'none'}"
