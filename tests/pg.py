"""Find a PostgreSQL server for the tests, and make one fresh database per test.

The server comes from ``HCAPO_TEST_PG_URL`` (e.g. ``postgresql://postgres@127.0.0.1:5432/postgres``,
which ``bash .ci/start-postgres.sh`` prints). Without it, or when it cannot be reached,
PostgreSQL tests skip with the reason, so a plain clone's test run passes.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

ENV = "HCAPO_TEST_PG_URL"
_reachable: dict[str, str | None] = {}


def server_url() -> str:
    """The admin URL (a database we may CREATE DATABASE from), or skip the test."""
    url = os.environ.get(ENV)
    if not url:
        pytest.skip(
            f"no PostgreSQL: set {ENV}=postgresql://user@host:port/postgres "
            "(e.g. export {ENV}=$(bash .ci/start-postgres.sh))".replace("{ENV}", ENV)
        )
    try:
        import psycopg
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'psycopg[binary]')")
    if url not in _reachable:
        try:
            import psycopg

            psycopg.connect(_libpq(url), connect_timeout=30).close()
            _reachable[url] = None
        except Exception as exc:
            _reachable[url] = f"{type(exc).__name__}: {exc}".strip()
    if _reachable[url] is not None:
        pytest.skip(f"PostgreSQL at {ENV} is not reachable: {_reachable[url]}")
    return url


def _libpq(url: str) -> str:
    """psycopg wants postgresql://; accept the SQLAlchemy spelling too."""
    for prefix in ("postgresql+psycopg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    return url


def _with_database(url: str, name: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(_libpq(url)).set(database=name).render_as_string(hide_password=False)


@contextmanager
def fresh_database(prefix: str = "test") -> Iterator[str]:
    """CREATE DATABASE <prefix>_<random>, yield its postgresql:// URL, DROP it afterwards."""
    import psycopg

    admin = _libpq(server_url())
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            # FORCE (PG 13+) ends sessions a killed worker may have left behind.
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
