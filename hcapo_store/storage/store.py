"""The Store: one opened database (engine + schema check) that every service works on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from hcapo_store.storage import db
from hcapo_store.errors import StoreError


@dataclass
class Store:
    url: str
    engine: Engine

    @classmethod
    def open(cls, location: str | None = None, *, create: bool = True) -> "Store":
        """Open (and, when blank and ``create``, initialise) a database.

        A database behind the code's schema is refused with the command that upgrades it.
        """
        url = db.resolve_url(location)
        engine = db.make_engine(url)
        try:
            db.check_schema(engine, create=create)
        except SQLAlchemyError as exc:
            engine.dispose()
            raise StoreError(f"cannot open database {db.display_url(url)}: {exc}") from exc
        except BaseException:
            engine.dispose()
            raise
        return cls(url=url, engine=engine)

    @property
    def display(self) -> str:
        return db.display_url(self.url)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query(self, sql: str, params: dict[str, Any] | None = None, *, read_only: bool = True) -> tuple[list[str], list[tuple]]:
        """Run one SQL statement; read-only unless asked (SQLite: ``query_only`` pragma;
        PostgreSQL: a ``READ ONLY`` transaction). ``params`` are named (``:name``)."""
        try:
            with self.engine.connect() as conn:
                if read_only:
                    _enter_read_only(conn)
                try:
                    if params:
                        # Named :params, the same on every engine.
                        result = conn.execute(text(sql), params)
                    elif conn.dialect.name == "postgresql":
                        cols, rows = _pg_raw(conn, sql, read_only=read_only)
                        conn.commit()
                        return cols, rows
                    else:
                        result = conn.exec_driver_sql(sql)
                    if not result.returns_rows:
                        conn.commit()
                        return [], []
                    cols = list(result.keys())
                    rows = [tuple(r) for r in result]
                    conn.commit()
                    return cols, rows
                finally:
                    if read_only:
                        _leave_read_only(conn)
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            raise StoreError(f"SQL error: {orig}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg"):  # from _pg_raw
                raise StoreError(f"SQL error: {exc}") from exc
            raise


def _pg_raw(conn, sql: str, *, read_only: bool) -> tuple[list[str], list[tuple]]:  # noqa: ANN001
    """User SQL on PostgreSQL, sent as written (a ``%`` is not a placeholder).

    Read-only statements go through the extended protocol (``prepare=True``), which
    accepts exactly one statement: ``COMMIT; DELETE …`` cannot escape the read-only
    transaction the way it could with the simple protocol.
    """
    with conn.connection.driver_connection.cursor() as cur:
        cur.execute(sql, prepare=True if read_only else None)
        if cur.description is None:
            return [], []
        return [d.name for d in cur.description], [tuple(r) for r in cur.fetchall()]


def _enter_read_only(conn) -> None:  # noqa: ANN001
    if conn.dialect.name == "sqlite":
        conn.connection.driver_connection.execute("PRAGMA query_only = ON")
    else:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")


def _leave_read_only(conn) -> None:  # noqa: ANN001
    if conn.dialect.name == "sqlite":
        conn.connection.driver_connection.execute("PRAGMA query_only = OFF")


def count(store: Store, sql: str, **params: Any) -> int:
    with db.read(store.engine) as conn:
        return int(conn.execute(text(sql), params).scalar() or 0)
