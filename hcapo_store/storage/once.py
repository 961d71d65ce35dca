"""Insert once: a row that must exist at most once (by a unique key) is written with
``INSERT ... ON CONFLICT DO NOTHING``, so two writers racing for it never see an error: one
inserts, the other learns the row was there. Callers above storage neither catch
``IntegrityError`` nor read error texts to tell a lost race from a real failure.

SQLite (3.35+) and PostgreSQL both spell it this way; on PostgreSQL the second writer waits
for the first one's transaction and then does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, text


def insert_once(
    conn: Connection, table: str, row: Mapping[str, Any], *, unique: Sequence[str] | None, returning: str = "id"
) -> Any | None:
    """Insert ``row`` (column -> value) into ``table`` unless a row with the same ``unique``
    columns exists: the new row's ``returning`` column, or None when it was there already.
    ``unique=None``: unless the row collides with any of the table's unique constraints (a
    table with two, such as an episode's key+version and name+version, where a racing writer
    may take either first; the caller then looks again at what is there).
    ``table`` and the column names are the code's own identifiers, never user input."""
    columns = list(row)
    target = "" if unique is None else f"({', '.join(unique)}) "
    sql = (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(':' + c for c in columns)}) "
        f"ON CONFLICT {target}DO NOTHING RETURNING {returning}"
    )
    return conn.execute(text(sql), dict(row)).scalar()
