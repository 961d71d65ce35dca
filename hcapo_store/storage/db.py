"""Engines, transactions and schema versions (Alembic) for SQLite and PostgreSQL.

SQLite: WAL, foreign keys on, a busy timeout, and explicit ``BEGIN`` control so that
write transactions can take the write lock up front (``BEGIN IMMEDIATE``) instead of
failing on lock upgrade. Migrations run with foreign keys off (table rebuilds) and a
``PRAGMA foreign_key_check`` afterwards.

This module is the database's error boundary: connections are opened through ``read()``
and ``write()``, which turn SQLAlchemy and driver errors into ``StoreError`` subclasses
(``DatabaseLocked``, ``DatabaseFull``, ``NotAStore``), the way httpx maps transport errors.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from urllib.parse import quote

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from hcapo_store.errors import DatabaseFull, DatabaseLocked, NotAStore, SchemaOutOfDate, SchemaTooNew, StoreError
from hcapo_store.processes import remove_files_of_dead
from hcapo_store.storage.location import DEFAULT_DB, ENV_DB, display_url, resolve_url  # noqa: F401 - re-exported

ENV_BUSY_TIMEOUT = "HCAPO_STORE_BUSY_TIMEOUT"  # seconds a writer waits for SQLite's write lock
BUSY_TIMEOUT_MS = 60_000
MAX_BUSY_TIMEOUT_S = 86_400  # a day; SQLite takes the value as a C int of milliseconds
# Tables every hcapo-store database has had since revision 0001: a file without them is not ours.
CORE_TABLES = frozenset({"episodes", "messages", "steps", "scorers", "scores", "attempts"})


def busy_timeout_ms() -> int:
    raw = os.environ.get(ENV_BUSY_TIMEOUT)
    if not raw:
        return BUSY_TIMEOUT_MS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_BUSY_TIMEOUT_S:  # NaN fails this too
        raise StoreError(f"{ENV_BUSY_TIMEOUT}={raw!r} is not a number of seconds in [0, {MAX_BUSY_TIMEOUT_S}]")
    return int(seconds * 1000)


def _sqlite_hooks(engine: Engine) -> None:
    timeout_ms = busy_timeout_ms()

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {timeout_ms}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = "IMMEDIATE" if conn.get_execution_options().get("immediate") else "DEFERRED"
        conn.exec_driver_sql(f"BEGIN {mode}")


SQLITE_MAGIC = b"SQLite format 3\x00"


def sqlite_file(url: str) -> Path | None:
    """The file behind a SQLite URL (None: another engine, or in memory)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///") :]
    return Path(path) if path and path != ":memory:" else None


def preflight(url: str, *, create: bool) -> None:
    """Look at a SQLite file before any connection touches it (a connection switches the file
    to WAL): a file that is not a hcapo-store database is refused and left as it was, byte for
    byte; a missing file is an error unless ``create``. Only a new path, a zero-byte file or a
    SQLite file with no tables and no application id or user version may become a store."""
    path = sqlite_file(url)
    if path is None:
        return
    shown = display_url(url)
    if not path.exists():
        if create:
            return
        raise StoreError(
            f"no database at {shown}: check --db (or {ENV_DB}); `hcapo-store --db {shown} init` creates one"
        )
    if not path.is_file():
        raise NotAStore(f"{shown} is not a regular file: pass a database file with --db")
    try:
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError as exc:
        raise StoreError(f"cannot read {shown}: {exc.strerror or exc}") from exc
    if not header:
        return  # a zero-byte file: SQLite treats it as a new database
    if not header.startswith(SQLITE_MAGIC):
        raise NotAStore(f"{shown} is not a SQLite database; it was left untouched: pass another path with --db")
    user_version, application_id = int.from_bytes(header[60:64], "big"), int.from_bytes(header[68:72], "big")
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read {shown}: {exc}") from exc
    _refuse_foreign_tables(tables, shown)
    if tables:
        return  # a store
    if application_id or user_version:
        raise NotAStore(
            f"{shown} is another application's empty SQLite database (application id {application_id}, "
            f"user version {user_version}); it was left untouched: pass another path with --db"
        )


def make_engine(url: str) -> Engine:
    try:
        if url.startswith("sqlite"):
            path = sqlite_file(url)
            if path is not None and not path.parent.is_dir():  # as sqlite3 does: no folder is made
                raise StoreError(
                    f"cannot open database {path}: the folder {path.parent} does not exist "
                    "(create it first, or pass another path with --db)"
                )
            engine = create_engine(url, connect_args={"timeout": busy_timeout_ms() / 1000})
            _sqlite_hooks(engine)
        else:
            engine = create_engine(url, pool_pre_ping=True)
    except (SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot open database {display_url(url)}: {exc}") from exc
    except ValueError as exc:  # a URL SQLAlchemy cannot parse (a port that is not a number, ...)
        raise StoreError(
            f"cannot open database {display_url(url)}: the URL is malformed ({exc}); "
            "write it as postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE"
        ) from exc
    return engine


def _driver_error(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.Error) or type(exc).__module__.startswith("psycopg")


def store_error(exc: BaseException, url: str, waited: float | None = None) -> StoreError:
    """The library's error for a SQLAlchemy or driver error on the database at ``url``.

    The errors the first one caused are looked through too: after SQLITE_FULL SQLite rolls
    the transaction back itself, and the failing ``ROLLBACK TO SAVEPOINT`` hides the cause.
    ``waited``: seconds the failed block ran, so a lock error says whether SQLite waited out
    its busy timeout or gave up at once.
    """
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__context__
    for error in chain:
        specific = _specific_error(error, display_url(url), waited)
        if specific is not None:
            return specific
    orig = getattr(exc, "orig", None) or exc
    first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    return StoreError(f"database error on {display_url(url)}: {first}")


def _specific_error(exc: BaseException, where: str, waited: float | None = None) -> StoreError | None:
    orig = getattr(exc, "orig", None) or exc
    if not (_driver_error(orig) or isinstance(exc, SQLAlchemyError)):
        return None
    name = getattr(orig, "sqlite_errorname", "") or ""
    state = getattr(orig, "sqlstate", None) or ""
    message = str(orig)
    if state in ("55P03", "40P01"):  # PostgreSQL: lock_not_available, deadlock_detected
        return DatabaseLocked(
            f"database {where}: a lock could not be taken ({message.strip().splitlines()[0]}); "
            "the transaction was rolled back, rerun it"
        )
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in message:
        timeout_s = busy_timeout_ms() / 1000
        if waited is not None and waited < timeout_s * 0.9:
            # SQLite answers BUSY at once, without waiting, when waiting could deadlock (a
            # reader that wants to write while another process writes): not a long-held lock.
            return DatabaseLocked(
                f"database {where} is busy: another process wrote to it at the same moment, and SQLite "
                f"gave up after {waited:.1f}s instead of waiting (its busy timeout, {timeout_s:g}s, cannot help "
                "a transaction that read before it wrote); the transaction was rolled back, rerun it"
            )
        return DatabaseLocked(
            f"database {where} is locked: another process held its write lock longer than "
            f"{busy_timeout_ms() / 1000:g}s (env {ENV_BUSY_TIMEOUT}); the transaction was rolled back, "
            "rerun when the other process is done"
        )
    if name.startswith("SQLITE_FULL") or state == "53100" or "database or disk is full" in message:
        return DatabaseFull(
            f"database {where} is full (no space left on its disk, or its size limit): "
            "the transaction was rolled back; free space and rerun"
        )
    if name.startswith("SQLITE_NOTADB") or "file is not a database" in message:
        return NotAStore(f"{where} is not a SQLite database; pass the path of an hcapo-store database with --db")
    return None


@contextmanager
def mapped_errors(url: str) -> Iterator[None]:
    """Raise SQLAlchemy and driver errors of the block as ``store_error``.

    Constraint violations stay ``IntegrityError``: the callers that expect them (workers
    racing to insert the same row) handle them; anywhere else they are bugs.
    """
    started = time.monotonic()
    try:
        yield
    except IntegrityError:
        raise
    except SQLAlchemyError as exc:
        raise store_error(exc, url, time.monotonic() - started) from exc
    except Exception as exc:
        if _driver_error(exc):
            raise store_error(exc, url, time.monotonic() - started) from exc
        raise


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """A connection for reading (its errors mapped to ``StoreError``)."""
    with mapped_errors(str(engine.url)), engine.connect() as conn:
        yield conn


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A short write transaction; on SQLite it takes the write lock at BEGIN.

    Any error rolls the whole transaction back; database errors are raised as ``StoreError``.
    """
    with mapped_errors(str(engine.url)), engine.connect().execution_options(immediate=True) as conn:
        with conn.begin():
            yield conn


def _migrations_dir() -> str:
    # A source checkout's own migrations/ first (editable installs, worktrees); an
    # installed wheel carries them as the hcapo_store.migrations package.
    checkout = Path(__file__).resolve().parents[2] / "migrations"
    if (checkout / "env.py").is_file():
        return str(checkout)
    from importlib.resources import files

    return str(files("hcapo_store.migrations"))


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    # ConfigParser interpolation: a literal % in a path must be doubled.
    cfg.set_main_option("script_location", _migrations_dir().replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head_revision() -> str:
    """The newest revision of this package's migrations, read once per process: the revisions
    are frozen files shipped with the package (their directory fixed by where this module is),
    and reading them is ~15 ms that every store open paid again (``check_schema``)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with read(engine) as conn:
        return MigrationContext.configure(conn).get_current_revision()


def table_names(engine: Engine) -> set[str]:
    with read(engine) as conn:
        return set(inspect(conn).get_table_names())


def is_blank(engine: Engine) -> bool:
    return not table_names(engine)


def refuse_foreign(engine: Engine) -> None:
    """Raise ``NotAStore`` for a database with tables but not hcapo-store's (or no schema revision)."""
    _refuse_foreign_tables(table_names(engine), display_url(str(engine.url)))


def _refuse_foreign_tables(tables: set[str], shown: str) -> None:
    """``NotAStore`` when a database has tables and they are not hcapo-store's."""
    if tables and not CORE_TABLES | {"alembic_version"} <= tables:
        listed = ", ".join(sorted(tables)[:5]) + (", …" if len(tables) > 5 else "")
        raise NotAStore(
            f"{shown} is not an hcapo-store database (its tables: {listed}); "
            "it was left untouched: pass another path with --db"
        )


# PostgreSQL: the transaction-level advisory lock that serialises migrations of one database.
MIGRATION_LOCK_KEY = 0x68636170  # "hcap"


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade in one transaction; SQLite foreign keys are off during table rebuilds.

    Processes that open a new or old store together (two ``follow`` or ``ingest`` started at
    once) are serialised: the transaction takes the write lock before Alembic reads the
    revision (SQLite ``BEGIN IMMEDIATE``, waiting the busy timeout; PostgreSQL an advisory
    lock), so the first migrates and the others find the head and change nothing. A
    deferred transaction would read first and then fail at once on the lock upgrade.
    """
    sqlite = engine.dialect.name == "sqlite"
    with read(engine) as conn:
        # The pragma is a no-op inside a transaction, so it goes to the raw connection.
        raw = conn.connection.driver_connection if sqlite else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys = OFF")
        try:
            with conn.execution_options(immediate=True).begin():
                if not sqlite:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
                command.upgrade(alembic_config(conn), revision)
                if sqlite:
                    bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if bad:
                        raise StoreError(f"upgrade left broken foreign keys: {bad[:5]}")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys = ON")


def backup(engine: Engine) -> Path | None:
    """Copy a SQLite file before an upgrade (``VACUUM INTO``); None for other engines.

    The copy is written under a temporary name and renamed when complete, so a killed
    upgrade never leaves a partial file named like a backup.
    """
    if engine.dialect.name != "sqlite":
        return None
    path = Path(str(engine.url.database))
    rev = current_revision(engine) or "none"
    target = path.with_name(f"{path.name}.bak-{rev}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.bak-{rev}.{n}")
        n += 1
    _remove_dead_partials(path)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    partial.unlink(missing_ok=True)  # left by an earlier process with our pid
    try:
        with read(engine) as conn:
            sqlite_conn = conn.connection.driver_connection
            if sqlite_conn is None:  # only after the pool invalidated it
                raise StoreError(f"cannot back up {path}: its database connection was closed; run the command again")
            sqlite_conn.execute("VACUUM INTO ?", (str(partial),))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _remove_dead_partials(path: Path) -> None:
    """Partial backups left by upgrades killed before their rename (their process is gone)."""
    remove_files_of_dead(  # the copy or its side file
        path.parent.glob(f".{glob_escape(path.name)}.bak-*.partial-*"),
        re.compile(r"\.partial-(\d+)(-journal|-wal|-shm)?$"),
    )


@dataclass(frozen=True)
class UpgradeResult:
    url: str  # for display: credentials masked
    before: str | None
    head: str
    backup: Path | None

    @property
    def changed(self) -> bool:
        return self.before != self.head


def upgrade_database(db: str | os.PathLike[str] | None, *, take_backup: bool = True) -> UpgradeResult:
    """``db upgrade``: bring a database to head; a SQLite file is copied first unless told not to."""
    url = resolve_url(db)
    preflight(url, create=True)  # a new path is created at head, as `init` would
    engine = make_engine(url)
    try:
        before, tables = schema_state(engine)
        _refuse_foreign_tables(tables, display_url(url))
        head = head_revision()
        refuse_unknown_revision(before, display_url(url), head)
        copy = None
        if before != head:
            if before is not None and take_backup:
                copy = backup(engine)
            upgrade(engine)
        return UpgradeResult(display_url(url), before, head, copy)
    finally:
        engine.dispose()


def schema_state(engine: Engine) -> tuple[str | None, set[str]]:
    """The schema revision and the table names, read in one transaction (one snapshot).

    Two separate reads can straddle another process's first migration: the revision read
    before its commit (none), the tables after it (all of them), a state no store is in.
    """
    with read(engine) as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        tables = set(inspect(conn).get_table_names())
    return current, tables


def check_schema(engine: Engine, *, create: bool = True) -> None:
    """Refuse a database behind or ahead of head; initialise a blank one when allowed."""
    head = head_revision()
    current, tables = schema_state(engine)
    if current == head:
        return
    url = display_url(str(engine.url))
    _refuse_foreign_tables(tables, url)
    if current is None and not tables:
        if create:
            upgrade(engine)
            return
        raise StoreError(f"{url} is not a hcapo-store database yet: run `hcapo-store --db {url} init`")
    refuse_unknown_revision(current, url, head)
    raise SchemaOutOfDate(url, current, head)


def refuse_unknown_revision(current: str | None, url: str, head: str) -> None:
    """``SchemaTooNew`` for a revision this version's migrations do not know."""
    if current is None:
        return
    script = ScriptDirectory.from_config(alembic_config())
    if current not in {rev.revision for rev in script.walk_revisions()}:
        raise SchemaTooNew(
            f"Database {url} is at revision {current}, unknown to this hcapo-store "
            f"(head {head}); it was written by a newer version: upgrade hcapo-store."
        )


def sql_now(conn: Connection) -> float:
    """The database server's clock (PostgreSQL) or the local one (SQLite), epoch seconds."""
    if conn.dialect.name == "postgresql":
        return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    from hcapo_store.clock import now

    return now()
