"""Alembic environment for hcapo-store.

The application passes an open connection in ``config.attributes["connection"]``
(see ``hcapo_store/db.py``); developers can run ``alembic -x db=PATH_OR_URL …`` from
the repository root (``[tool.alembic]`` in pyproject.toml, no alembic.ini).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from hcapo_store.storage.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: batch mode rebuilds tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from hcapo_store.storage.db import resolve_url

    db = context.get_x_argument(as_dictionary=True).get("db")
    if not db:
        raise SystemExit("pass the database with: alembic -x db=PATH_OR_URL <command>")
    engine = create_engine(resolve_url(db), poolclass=pool.NullPool)
    with engine.begin() as conn:
        _run(conn)


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
run_migrations_online()
