"""episode identity and unique names

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Why: 0001 keyed an episode by its absolute path (``path#episode_id`` for JSONL) and named
it by its directory's basename, so a copied or moved tree became new episodes, every run
had an ``episode_001``, and JSONL ids collided (``1`` vs ``"1"``, an id "line2" vs an
id-less line 2). This revision recomputes every episode's key from its stored raw source
(a Pi session's header id, else a hash of the session; a JSONL line's normalised id
scoped by the file name, else a hash of the line) and gives every episode a unique name
(``pg-01/episode_001``, ``eps.jsonl#7``). Rows that now share a key become versions of one
episode (numbered by ingest order, the latest current row stays current); rows that 0001
had merged under one key are split again, each part keeping its latest row current.
Nothing is deleted: ids, messages, steps, scores, attempts, tags and credits are kept.
``name`` + ``version`` becomes unique (an index; the views are unchanged). The new column
``source_path`` keeps where each version was read from (for 0001 rows: the old key's path).

Frozen history: the key and name rules are copied here as they were at this revision.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from collections import defaultdict
from pathlib import PurePosixPath
from typing import Any, Iterator

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

CHUNK = 500

# ---- key and name rules at this revision ------------------------------------------------------


def _session_key(session: bytes) -> str:
    first = next((line for line in session.split(b"\n") if line.strip()), b"")
    try:
        header = json.loads(first)
    except ValueError:
        header = None
    ident = header.get("id") if isinstance(header, dict) and header.get("type") == "session" else None
    if isinstance(ident, str) and ident.strip():
        return f"pi:{ident.strip()}"
    return "pi-sha256:" + hashlib.sha256(session).hexdigest()


def _normalise_id(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not an id")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not an id")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _ancestors(path: PurePosixPath) -> tuple[str, ...]:
    return tuple(p.name for p in path.parents if p.name)


Identity = tuple[str, str, tuple[str, ...], str]  # key, name, name prefixes, source path


def _dir_identity(old_key: str, raw: bytes) -> Identity:
    """(key, name, prefixes) of a Pi episode directory ingested by 0001 as ``old_key`` (its path)."""
    files = json.loads(zlib.decompress(raw))
    session = files["pi_session.jsonl"].encode("utf-8", "surrogateescape")
    path = PurePosixPath(old_key)
    root = path.parent if path.parent.name else path  # 0001 did not record the root: assume the parent
    name = f"{root.name}/{path.name}" if root != path else path.name
    return _session_key(session), name, _ancestors(root), old_key


def _jsonl_identity(old_key: str, raw: bytes) -> Identity:
    """(key, name, prefixes) of a JSONL line ingested by 0001 as ``<path>#<id or lineN>``."""
    line = zlib.decompress(raw)
    obj = json.loads(line)
    old_id = obj.get("episode_id") if isinstance(obj, dict) else None
    try:
        ident = _normalise_id(old_id)
    except ValueError:
        ident = None
    if old_id is not None:
        path, lineno = PurePosixPath(old_key[: -(len(str(old_id)) + 1)]), None
    else:
        match = re.fullmatch(r"(.*)#line(\d+)", old_key, re.S)
        assert match is not None
        path, lineno = PurePosixPath(match.group(1)), int(match.group(2))
    if ident is not None:
        return f"jsonl:{path.name}#{ident}", f"{path.name}#{ident}", _ancestors(path), str(path)
    key = "jsonl-sha256:" + hashlib.sha256(line.strip()).hexdigest()
    return key, f"{path.name}:{lineno if lineno is not None else old_id}", _ancestors(path), str(path)


def _identity(old_key: str, source_format: str, raw: bytes) -> Identity:
    try:
        if source_format == "openai_jsonl":
            return _jsonl_identity(old_key, raw)
        return _dir_identity(old_key, raw)
    except (ValueError, KeyError, AssertionError, zlib.error, AttributeError, TypeError):
        # An unreadable raw source keeps its old key (marked) rather than losing the row.
        path = PurePosixPath(old_key.split("#", 1)[0])
        return f"legacy:{old_key}", path.name or old_key, _ancestors(path), str(path)


def _candidates(name: str, prefixes: tuple[str, ...]) -> Iterator[str]:
    yield name
    for i in range(1, len(prefixes) + 1):
        yield "/".join(reversed(prefixes[:i])) + "/" + name
    n = 2
    while True:
        yield f"{name}~{n}"
        n += 1


# ---- the data migration -------------------------------------------------------------------------


Row = tuple[int, bool, str, tuple[str, ...], str]  # id, was current, name, prefixes, source path


def _read(conn: sa.Connection) -> dict[str, list[Row]]:
    """New key -> [(id, was current, name, prefixes, path)] in id order, reading raw sources in chunks."""
    groups: dict[str, list[Row]] = defaultdict(list)
    last = 0
    while True:
        rows = conn.execute(sa.text(
            "SELECT id, source_key, source_format, is_current, raw_source FROM episodes "
            "WHERE id > :last ORDER BY id LIMIT :n"), {"last": last, "n": CHUNK}).all()
        if not rows:
            return groups
        for ep_id, old_key, fmt, current, raw in rows:
            key, name, prefixes, path = _identity(old_key, fmt, bytes(raw))
            groups[key].append((ep_id, bool(current), name, prefixes, path))
        last = rows[-1][0]


def _plan(groups: dict[str, list[Row]]) -> list[dict[str, Any]]:
    """One update per row: key, a unique name per key, versions 1..n with the current row last."""
    updates: list[dict[str, Any]] = []
    used: set[str] = set()
    for key, rows in sorted(groups.items(), key=lambda kv: kv[1][0][0]):
        currents = [r for r in rows if r[1]]
        chosen = (currents or rows)[-1]  # the latest current row; none (0001 merged it away): the latest row
        first = rows[0]  # named where it was first ingested, as the pipeline names new episodes
        name = next(n for n in _candidates(first[2], first[3]) if n not in used)
        used.add(name)
        ordered = sorted(rows, key=lambda r: (r is chosen, r[0]))
        for version, row in enumerate(ordered, start=1):
            updates.append({"id": row[0], "k": key, "n": name, "v": version, "c": row is chosen, "p": row[4]})
    return updates


def upgrade() -> None:
    conn = op.get_bind()
    op.add_column('episodes', sa.Column('source_path', sa.Text(), nullable=True))
    updates = _plan(_read(conn))
    # Negative versions first: no (key, version) pair can clash while rows are rewritten.
    conn.execute(sa.text("UPDATE episodes SET version = -id"))
    for i in range(0, len(updates), CHUNK):
        conn.execute(sa.text("UPDATE episodes SET source_key = :k, name = :n, version = :v, is_current = :c, source_path = :p "
                             "WHERE id = :id"), updates[i:i + CHUNK])
    # A unique index, not a table rebuild: the views over episodes stay as they are.
    op.create_index('ix_episodes_name_version', 'episodes', ['name', 'version'], unique=True)


def downgrade() -> None:
    # The schema only: the old path keys cannot be recomputed (restore the backup `db upgrade` made).
    op.drop_index('ix_episodes_name_version', table_name='episodes')
    op.drop_column('episodes', 'source_path')
