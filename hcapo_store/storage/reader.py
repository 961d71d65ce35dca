"""A PostgreSQL role that can only read the store, for user SQL (``hcapo-store sql``).

The read-only guard of ``readonly.py`` (a rolled-back ``READ ONLY`` transaction, server
functions with side effects refused by name) runs user SQL as the URL's own role; a
superuser URL can still read server files or catalogs through functions the guard does not
name. ``db reader-role`` creates a login role with ``SELECT`` on the store's tables and
nothing else (no superuser, no role creation, read-only transactions by default, a statement
time limit), and ``sql`` then connects as that role: what it may do is what PostgreSQL lets
the role do, whatever the SQL says. ``SET ROLE`` inside the URL's own session would not do:
the SQL could set the role back (``set_config('role', …)``).

Which URL ``sql`` uses: ``HCAPO_STORE_READER_URL`` when set; else, when the role
``hcapo_store_reader`` exists, the store's URL with that user (and
``HCAPO_STORE_READER_PASSWORD`` as its password, when set); else the URL's own role.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from hcapo_store.errors import StoreError, UsageError
from hcapo_store.storage import db

READER_ROLE = "hcapo_store_reader"
ENV_READER_URL = "HCAPO_STORE_READER_URL"
ENV_READER_PASSWORD = "HCAPO_STORE_READER_PASSWORD"
READER_STATEMENT_TIMEOUT_S = 300  # the role's own ceiling; `sql --timeout` sets a lower one per statement


@dataclass(frozen=True)
class ReaderRole:
    name: str
    created: bool  # False: it existed; its grants were brought up to date
    tables: int  # the store's tables it may read
    url: str  # how `sql` connects as it (password masked)


def _role_exists(engine: Engine, name: str) -> bool:
    with db.read(engine) as conn:
        return conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": name}).first() is not None


def reader_url(engine: Engine, url: str) -> str | None:
    """The URL user SQL on the store at ``url`` runs under (see the module docstring), or None."""
    if engine.dialect.name != "postgresql":
        return None
    explicit = os.environ.get(ENV_READER_URL)
    if explicit:
        return db.resolve_url(explicit)
    if not _role_exists(engine, READER_ROLE):
        return None
    return _as_role(url, READER_ROLE, os.environ.get(ENV_READER_PASSWORD))


def _as_role(url: str, name: str, password: str | None) -> str:
    return make_url(url).set(username=name, password=password).render_as_string(hide_password=False)


def create_reader_role(engine: Engine, url: str, name: str = READER_ROLE, password: str | None = None) -> ReaderRole:
    """Create (or bring up to date) a login role that may only read the tables of the store
    at ``url`` (``engine``: its engine)."""
    if engine.dialect.name != "postgresql":
        raise UsageError("a reader role is a PostgreSQL role; SQLite's read-only SQL needs none (its authorizer)")
    if not name or len(name.encode()) > 63:
        raise UsageError(f"role name {name!r}: 1 to 63 bytes")
    from psycopg import sql as pgsql

    role = pgsql.Identifier(name)
    existed = _role_exists(engine, name)
    try:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            with raw.cursor() as cur:
                schema, database = cur.execute("SELECT current_schema(), current_database()").fetchone() or ("", "")
                attrs = pgsql.SQL(
                    "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT"
                    + (" PASSWORD {}" if password is not None else "")
                ).format(pgsql.Literal(password))
                verb = "ALTER" if existed else "CREATE"
                cur.execute(pgsql.SQL(verb + " ROLE {} ").format(role) + attrs)
                for statement in (
                    "ALTER ROLE {role} SET default_transaction_read_only = on",
                    f"ALTER ROLE {{role}} SET statement_timeout = '{READER_STATEMENT_TIMEOUT_S}s'",
                    "GRANT CONNECT ON DATABASE {database} TO {role}",
                    "GRANT USAGE ON SCHEMA {schema} TO {role}",
                    "GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}",
                    # tables later revisions add (created by this role, which runs upgrades)
                    "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT ON TABLES TO {role}",
                ):
                    cur.execute(
                        pgsql.SQL(statement).format(
                            role=role, database=pgsql.Identifier(database), schema=pgsql.Identifier(schema)
                        )
                    )
                tables = cur.execute(
                    "SELECT count(*) FROM information_schema.role_table_grants "
                    "WHERE grantee = %s AND privilege_type = 'SELECT' AND table_schema = %s",
                    (name, schema),
                ).fetchone()
            raw.commit()
    except Exception as exc:
        if type(exc).__module__.startswith("psycopg"):
            raise StoreError(
                f"cannot create the reader role {name!r} on {db.display_url(url)}: {exc}; "
                "run this as the store's owner with the CREATEROLE privilege"
            ) from exc
        raise
    shown = make_url(_as_role(url, name, password)).render_as_string(hide_password=True)
    return ReaderRole(name, not existed, int(tables[0]) if tables else 0, shown)
