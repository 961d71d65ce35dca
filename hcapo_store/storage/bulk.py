"""Many rows of plain values into one table, straight through the database driver.

``conn.execute(insert(Table), [dict, ...])`` processes every row's parameters in Python
(SQLAlchemy's per-row binding: about a fifth of ingest's storing time for ~330 rows per
episode). Rows whose values are already what the driver takes (str, int, float, bool,
None) need none of that: one statement, compiled once per dialect and column list, and
the driver's ``executemany``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, Dialect, Table

from hcapo_store.storage.models import Base

_PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s", "numeric": ":{n}"}


def insert_rows(conn: Connection, model: type[Base], columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> None:
    """INSERT ``rows`` (tuples in ``columns`` order) into ``model``'s table in one executemany."""
    if not rows:
        return
    table = model.__table__
    assert isinstance(table, Table)  # a mapped class's own table, not a join or a view
    conn.exec_driver_sql(_insert_sql(conn.dialect, table, tuple(columns)), list(rows))


@lru_cache(maxsize=64)  # per engine's dialect, table and column list: a handful
def _insert_sql(dialect: Dialect, table: Table, columns: tuple[str, ...]) -> str:
    unknown = [c for c in columns if c not in table.c]
    if unknown:
        raise ValueError(f"{table.name} has no column {unknown[0]!r}")
    paramstyle = dialect.paramstyle
    if paramstyle not in _PLACEHOLDERS:
        raise ValueError(f"driver parameter style {paramstyle!r} is not supported here")
    preparer = dialect.identifier_preparer
    names = ", ".join(preparer.quote(c) for c in columns)
    marks = ", ".join(_PLACEHOLDERS[paramstyle].format(n=i + 1) for i in range(len(columns)))
    return f"INSERT INTO {preparer.format_table(table)} ({names}) VALUES ({marks})"
