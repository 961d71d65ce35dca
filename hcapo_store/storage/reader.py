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

A role is not trusted by its name: anyone with CREATEROLE can make one called
``hcapo_store_reader``. Before ``sql`` runs as it, :func:`check_reader` asks the server,
through the store's own connection, what the role can do, and refuses (one line) a role
that can do more than read the store or cannot read it, and a reader URL that reaches
another database or server. Its ``search_path`` does not matter: every user query runs with
the store's schema pinned (``Store.query``), so tables of another schema cannot stand in
for the store's.
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


# What a reader may not do to any table of the store (has_table_privilege takes the list).
_WRITE_PRIVILEGES = "INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER"


def store_schema(engine: Engine) -> str:
    """The schema the store's tables are in: the owner connection's current schema."""
    with db.read(engine) as conn:
        return str(conn.execute(text("SELECT current_schema()")).scalar_one())


def _where(conn) -> tuple:
    """What identifies one database on one running server."""
    return tuple(
        conn.execute(
            text(
                "SELECT (SELECT oid FROM pg_database WHERE datname = current_database()), "
                "pg_postmaster_start_time(), current_database()"
            )
        ).one()
    )


def check_reader(owner: Engine, reader: Engine, schema: str) -> str:
    """The reader engine's role, when it can only read the store's tables; else ``StoreError``
    naming what it can do. Asked through ``owner`` (the store's own connection), not the role."""
    with db.read(reader) as conn:
        role = str(conn.execute(text("SELECT current_user")).scalar_one())
        theirs = _where(conn)
    problems: list[str] = []
    with db.read(owner) as conn:
        if _where(conn) != theirs:
            problems.append(f"reaches database {theirs[2]!r} on another server or database than the store's")
        facts = conn.execute(
            text(
                "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls "
                "FROM pg_roles WHERE rolname = :r"
            ),
            {"r": role},
        ).one()
        powers = ["SUPERUSER", "CREATEROLE", "CREATEDB", "REPLICATION", "BYPASSRLS"]
        problems += [f"has {p}" for p, held in zip(powers, facts, strict=True) if held]
        member_of = (
            conn.execute(
                text(
                    "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid "
                    "JOIN pg_roles r ON r.oid = m.member WHERE r.rolname = :r ORDER BY 1"
                ),
                {"r": role},
            )
            .scalars()
            .all()
        )
        if member_of:
            problems.append("is a member of " + ", ".join(member_of))
        tables = (
            conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = :s ORDER BY 1"), {"s": schema})
            .scalars()
            .all()
        )
        for table in tables:
            qualified = '"' + schema.replace('"', '""') + '"."' + table.replace('"', '""') + '"'
            can_read, can_write = conn.execute(
                text("SELECT has_table_privilege(:r, :t, 'SELECT'), has_table_privilege(:r, :t, :w)"),
                {"r": role, "t": qualified, "w": _WRITE_PRIVILEGES},
            ).one()
            if can_write:
                problems.append(f"may write to {table}")
            if not can_read and table in db.CORE_TABLES:
                problems.append(f"may not read {table}")
        if conn.execute(text("SELECT has_schema_privilege(:r, :s, 'CREATE')"), {"r": role, "s": schema}).scalar():
            problems.append(f"may create tables in schema {schema}")
    if problems:
        raise StoreError(
            f"read-only SQL would run as the role {role!r}, which {'; '.join(problems[:6])}: `sql` does not use it. "
            f"Recreate it with `hcapo-store db reader-role` as the store's owner, drop it, or set {ENV_READER_URL} "
            "to a role that can only read the store"
        )
    return role


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
