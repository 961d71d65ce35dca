"""Engines, transactions and schema versions (Alembic) for SQLite and PostgreSQL.

SQLite: WAL, foreign keys on, a busy timeout, and explicit ``BEGIN`` control so that
write transactions can take the write lock up front (``BEGIN IMMEDIATE``) instead of
failing on lock upgrade. Migrations run with foreign keys off (table rebuilds) and a
``PRAGMA foreign_key_check`` afterwards.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from hcapo_store.errors import SchemaOutOfDate, SchemaTooNew, StoreError
from hcapo_store.storage.location import DEFAULT_DB, ENV_DB, display_url, resolve_url  # noqa: F401 - re-exported

BUSY_TIMEOUT_MS = 60_000


def _sqlite_hooks(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # noqa: ANN001 - DB-API object
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = "IMMEDIATE" if conn.get_execution_options().get("immediate") else "DEFERRED"
        conn.exec_driver_sql(f"BEGIN {mode}")


def make_engine(url: str) -> Engine:
    try:
        if url.startswith("sqlite"):
            path = url[len("sqlite:///"):]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
            _sqlite_hooks(engine)
        else:
            engine = create_engine(url, pool_pre_ping=True)
    except (SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot open database {display_url(url)}: {exc}") from exc
    return engine


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A short write transaction; on SQLite it takes the write lock at BEGIN."""
    with engine.connect().execution_options(immediate=True) as conn:
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


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except OperationalError as exc:
        raise StoreError(f"cannot read database {display_url(str(engine.url))}: {exc.orig}") from exc


def is_blank(engine: Engine) -> bool:
    with engine.connect() as conn:
        return not inspect(conn).get_table_names()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade in one transaction; SQLite foreign keys are off during table rebuilds."""
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        # The pragma is a no-op inside a transaction, so it goes to the raw connection.
        raw = conn.connection.driver_connection if sqlite else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys = OFF")
        try:
            with conn.begin():
                command.upgrade(alembic_config(conn), revision)
                if sqlite:
                    bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if bad:
                        raise StoreError(f"upgrade left broken foreign keys: {bad[:5]}")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys = ON")


def backup(engine: Engine) -> Path | None:
    """Copy a SQLite file before an upgrade (``VACUUM INTO``); None for other engines."""
    if engine.dialect.name != "sqlite":
        return None
    path = Path(str(engine.url.database))
    rev = current_revision(engine) or "none"
    target = path.with_name(f"{path.name}.bak-{rev}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.bak-{rev}.{n}")
        n += 1
    with engine.connect() as conn:
        conn.connection.driver_connection.execute("VACUUM INTO ?", (str(target),))
    return target


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
    engine = make_engine(url)
    try:
        before = current_revision(engine)
        head = head_revision()
        copy = None
        if before != head:
            if before is not None and take_backup:
                copy = backup(engine)
            upgrade(engine)
        return UpgradeResult(display_url(url), before, head, copy)
    finally:
        engine.dispose()


def check_schema(engine: Engine, *, create: bool = True) -> None:
    """Refuse a database behind or ahead of head; initialise a blank one when allowed."""
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return
    url = display_url(str(engine.url))
    if current is None and is_blank(engine):
        if create:
            upgrade(engine)
            return
        raise StoreError(f"{url} is not a hcapo-store database yet: run `hcapo-store --db {url} init`")
    script = ScriptDirectory.from_config(alembic_config())
    known = {rev.revision for rev in script.walk_revisions()}
    if current not in known:
        raise SchemaTooNew(
            f"Database {url} is at revision {current}, unknown to this hcapo-store "
            f"(head {head}); it was written by a newer version: upgrade hcapo-store."
        )
    raise SchemaOutOfDate(url, current, head)


def sql_now(conn: Connection) -> float:
    """The database server's clock (PostgreSQL) or the local one (SQLite), epoch seconds."""
    if conn.dialect.name == "postgresql":
        return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    from hcapo_store.clock import now

    return now()
