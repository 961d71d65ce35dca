"""The Store: one opened database (engine + schema check) that every service works on."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from hcapo_store.errors import StoreError, StoreGone
from hcapo_store.storage import db, readonly


@dataclass
class Store:
    url: str
    engine: Engine
    # User SQL's own connection on PostgreSQL (``reader.py``): opened at the first such query.
    _reader: Engine | None = field(default=None, repr=False)
    _reader_checked: bool = field(default=False, repr=False)
    _schema: str | None = field(default=None, repr=False)  # PostgreSQL: the store's tables' schema
    _pg_system: bool | None = field(default=None, repr=False)  # may ``identity`` read the cluster's id

    @classmethod
    def open(cls, location: str | None = None, *, create: bool = True) -> Store:
        """Open (and, when blank and ``create``, initialise) a database.

        A database behind the code's schema is refused with the command that upgrades it.
        """
        url = db.resolve_url(location)
        db.preflight(url, create=create)
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

    def identity(self) -> tuple[Any, ...]:
        """What this database is, now: equal values, the same database. SQLite: its file's
        (device, inode); PostgreSQL: the cluster's system identifier (where the role may read
        it), the database's oid and the oids of the store's ``episodes`` and ``batches`` tables,
        so a database dropped and created again, or its tables dropped and migrated again,
        is another one. ``StoreGone`` (saying which) when it is not there: the file deleted,
        the database dropped, its tables dropped, or its server not answering. A long-running
        process (``follow``) compares it with the value it started with."""
        if self.dialect != "postgresql":
            now = _file_id(self.url)
            if now is None and db.sqlite_file(self.url) is not None:
                raise StoreGone(f"the database {self.display} was deleted")
            return ("sqlite", now)
        schema = self.schema  # read when the store was first used: kept
        try:
            with self.engine.connect() as conn:
                if self._pg_system is None:
                    self._pg_system = _pg_may_read_system(conn)
                found = _pg_identity(conn, schema, self._pg_system)
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            first = (str(orig).strip().splitlines() or [type(orig).__name__])[0].split("FATAL:")[-1].strip()
            if getattr(orig, "sqlstate", None) == "3D000" or ('database "' in first and "does not exist" in first):
                raise StoreGone(f"the database {self.display} was dropped ({first})") from exc
            raise StoreGone(f"the database {self.display} stopped answering ({first})") from exc
        if None in found[-2:]:
            raise StoreGone(f"the database {self.display} lost its tables (the store's schema was dropped)")
        return ("postgresql", *found)

    @property
    def display(self) -> str:
        return db.display_url(self.url)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()
        if self._reader is not None:
            self._reader.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query(
        self,
        sql: str,
        params: dict[str, Any] | None = None,
        *,
        read_only: bool = True,
        timeout: float | None = None,
        as_reader: bool = False,
    ) -> tuple[list[str], list[tuple]]:
        """Run one SQL statement; read-only unless asked (``storage/readonly.py``: SQLite's
        authorizer; PostgreSQL: a rolled-back ``READ ONLY`` transaction without server
        functions that have side effects). ``params`` are named (``:name``). ``timeout``:
        seconds the statement may run (then it is stopped, on the server for PostgreSQL);
        Ctrl-C stops it too (``KeyboardInterrupt``). ``as_reader`` (SQL a user wrote): on
        PostgreSQL, run it as the role that can only read the store when there is one
        (``storage/reader.py``). The whole result is returned: ``stream`` hands it over row
        by row instead."""
        out: list[tuple[list[str], list[tuple]]] = []
        self.stream(
            sql,
            lambda columns, rows: out.append((columns, list(rows))),
            params,
            read_only=read_only,
            timeout=timeout,
            as_reader=as_reader,
        )
        return out[0]

    def stream(
        self,
        sql: str,
        sink: Callable[[list[str], Iterator[tuple]], None],
        params: dict[str, Any] | None = None,
        *,
        read_only: bool = True,
        timeout: float | None = None,
        as_reader: bool = False,
    ) -> None:
        """``query`` that hands its result to ``sink(columns, rows)`` while the statement runs:
        ``rows`` is an iterator fetched as it is read, so a result of 20 million rows costs the
        memory of a few (``hcapo-store sql`` writes each row to its output). ``columns`` is
        empty for a statement that returns no rows. The time limit covers the sink's work."""
        engine = self.engine
        schema = None
        if self.dialect == "postgresql":
            schema = self.schema
            if read_only:
                readonly.pg_check(sql)
                if as_reader:
                    engine = self._reader_engine() or self.engine
        guard = None
        try:
            with _connect(engine, self) as conn, readonly.stoppable(conn, timeout) as stop:
                if read_only:
                    guard = _enter_read_only(conn)
                if schema is not None:
                    # The store's schema, whatever the role's own search_path says (a role made by
                    # someone else could point it at look-alike tables); pg_temp last, never first.
                    quoted = '"' + schema.replace('"', '""') + '"'
                    conn.exec_driver_sql(f"SET LOCAL search_path TO {quoted}, pg_catalog, pg_temp")
                    if read_only:
                        readonly.pg_check_volatile(conn, sql)
                try:
                    stop.run(lambda: _run(conn, sql, params, sink, read_only=read_only))
                    # Read-only work is never committed: what a READ ONLY transaction still
                    # allows (large objects, set_config) is rolled back.
                    conn.rollback() if read_only else conn.commit()
                finally:
                    if read_only:
                        _leave_read_only(conn)
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            raise _read_only_error(guard, orig) or StoreError(f"SQL error: {orig}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg"):  # from _pg_raw
                raise StoreError(f"SQL error: {exc}") from exc
            raise

    @property
    def schema(self) -> str:
        """PostgreSQL: the schema of the store's tables (the owner connection's current schema)."""
        if self._schema is None:
            from hcapo_store.storage.reader import store_schema

            self._schema = store_schema(self.engine)
        return self._schema

    def _reader_engine(self) -> Engine | None:
        """The reader role's engine, once the role is checked by what it can do (``reader.py``)."""
        if not self._reader_checked:
            from hcapo_store.storage.reader import check_reader, reader_url

            url = reader_url(self.engine, self.url)
            engine = None if url is None else db.make_engine(url)
            if engine is not None:
                try:
                    with _connect(engine, self):
                        pass  # a role that cannot connect: the one line of _connect
                    check_reader(self.engine, engine, self.schema)
                except BaseException:
                    engine.dispose()
                    raise
            self._reader = engine
            self._reader_checked = True
        return self._reader

    @property
    def files(self) -> list[Path]:
        """The database's file (SQLite), to keep outputs from overwriting it."""
        return [Path(self.display)] if self.dialect == "sqlite" else []


@contextmanager
def _connect(engine: Engine, store: Store) -> Iterator[Connection]:
    """A connection; one as the reader role that cannot be made says how to fix it."""
    try:
        conn = engine.connect()
    except SQLAlchemyError as exc:
        if engine is store.engine:
            raise
        from hcapo_store.storage.reader import ENV_READER_PASSWORD, ENV_READER_URL

        user = engine.url.username
        orig = getattr(exc, "orig", None) or exc
        raise StoreError(
            f"read-only SQL runs as the reader role {user!r}, which cannot connect: {str(orig).strip()}; "
            f"set {ENV_READER_PASSWORD} (or {ENV_READER_URL}), or recreate it with `hcapo-store db reader-role`"
        ) from exc
    with conn:
        yield conn


def _run(conn, sql: str, params: dict[str, Any] | None, sink: Callable[..., None], *, read_only: bool) -> None:
    if params:
        result = conn.execute(text(sql), params)  # named :params, the same on every engine
    elif conn.dialect.name == "postgresql":
        return _pg_raw(conn, sql, sink, read_only=read_only)
    else:
        result = conn.exec_driver_sql(sql)
    if not result.returns_rows:
        return sink([], iter(()))
    return sink(list(result.keys()), (tuple(r) for r in result))


def _read_only_error(guard, orig: BaseException) -> StoreError | None:
    return readonly.sqlite_error(guard, orig) if guard is not None else None


def _pg_raw(conn, sql: str, sink: Callable[..., None], *, read_only: bool) -> None:
    """User SQL on PostgreSQL, sent as written (a ``%`` is not a placeholder).

    Read-only statements go through the extended protocol, which accepts exactly one
    statement: ``COMMIT; DELETE …`` cannot escape the read-only transaction the way it could
    with the simple protocol. They are streamed (psycopg's single-row mode, also the
    extended protocol): the client holds a row at a time, not the whole result.
    """
    with conn.connection.driver_connection.cursor() as cur:
        if read_only:
            rows = cur.stream(sql)
            first = next(rows, None)  # the description comes with the first result
            if cur.description is None:
                return sink([], iter(()))
            head = [] if first is None else [tuple(first)]
            return sink([d.name for d in cur.description], itertools.chain(head, (tuple(r) for r in rows)))
        cur.execute(sql)
        if cur.description is None:
            return sink([], iter(()))
        return sink([d.name for d in cur.description], (tuple(r) for r in cur))


def _enter_read_only(conn):
    if conn.dialect.name == "sqlite":
        return readonly.sqlite_enter(conn.connection.driver_connection)
    readonly.pg_enter(conn)
    return None


def _leave_read_only(conn) -> None:
    if conn.dialect.name == "sqlite":
        readonly.sqlite_leave(conn.connection.driver_connection)


def count(store: Store, sql: str, **params: Any) -> int:
    with db.read(store.engine) as conn:
        return int(conn.execute(text(sql), params).scalar() or 0)


def _file_id(url: str) -> tuple[int, int] | None:
    path = db.sqlite_file(url)
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _pg_identity(conn: Connection, schema: str, system: bool) -> tuple[Any, ...]:
    """(system identifier or None, database oid, episodes' oid, batches' oid) in one statement;
    a table's oid is None when it is not there. ``system``: the role may call
    ``pg_control_system()`` (a server can revoke it)."""
    row = conn.execute(
        text(
            "SELECT "
            + ("(SELECT system_identifier FROM pg_catalog.pg_control_system()), " if system else "NULL, ")
            + "(SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()), "
            "to_regclass(format('%I.%I', CAST(:s AS text), 'episodes'))::oid, "
            "to_regclass(format('%I.%I', CAST(:s AS text), 'batches'))::oid"
        ),
        {"s": schema},
    ).one()
    return tuple(None if v is None else int(v) for v in row)


def _pg_may_read_system(conn: Connection) -> bool:
    return bool(
        conn.execute(text("SELECT has_function_privilege('pg_catalog.pg_control_system()', 'EXECUTE')")).scalar()
    )
