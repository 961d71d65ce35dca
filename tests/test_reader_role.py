"""User SQL on PostgreSQL runs as a role that can only read the store (issue 21), on a real server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage import reader
from hcapo_store.storage.store import Store


def _drop_role(name: str) -> None:
    import psycopg
    from pg import _libpq, server_url

    with psycopg.connect(_libpq(server_url()), autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{name}"')


@pytest.fixture
def pg(samples: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A fresh store with episodes, and the name of a reader role made for this test only
    (roles belong to the whole server: never the default name here)."""
    from pg import fresh_database

    name = f"reader_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(reader, "READER_ROLE", name)  # what `sql` looks for by itself
    monkeypatch.delenv(reader.ENV_READER_URL, raising=False)
    try:
        with fresh_database("reader") as url:
            with Store.open(url) as store:
                ingest(store, [samples])
            yield url, name
    finally:
        _drop_role(name)  # after its database (and the grants in it) is gone


def _sql(url: str, query: str, *extra: str):
    return CliRunner().invoke(cli, ["--db", url, "sql", query, *extra])


def test_sql_runs_as_the_reader_role_and_can_only_read_the_store(pg, monkeypatch):
    url, name = pg
    # Without the role, SQL runs as the URL's own (superuser) role: it reads the server's
    # password catalog, which no read-only guard by function names stops.
    assert _sql(url, "SELECT current_user").output.splitlines()[2].strip() == "postgres"
    assert _sql(url, "SELECT count(*) FROM pg_authid").exit_code == 0

    monkeypatch.setenv("READER_TEST_PW", "s3cret-pw")
    made = CliRunner().invoke(
        cli, ["--db", url, "db", "reader-role", "--name", name, "--password-env", "READER_TEST_PW", "--json"]
    )
    assert made.exit_code == 0, made.output
    assert '"created": true' in made.output and "s3cret-pw" not in made.output
    monkeypatch.setenv(reader.ENV_READER_PASSWORD, "s3cret-pw")

    who = _sql(url, "SELECT current_user", "--json")
    assert who.exit_code == 0 and name in who.output, who.output
    episodes = _sql(url, "SELECT count(*) AS n FROM episodes", "--json")
    assert episodes.exit_code == 0 and '"n": ' in episodes.output and '"n": 0' not in episodes.output
    for query in (
        "SELECT count(*) FROM pg_authid",  # the password catalog
        "SELECT pg_read_binary_file('/etc/passwd')",  # refused by the guard too
        "SELECT pg_ls_dir('.')",
    ):
        r = _sql(url, query)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert "permission denied" in r.output or "refused" in r.output or "read-only" in r.output, r.output
    stopped = _sql(url, "SELECT pg_sleep(30)", "--timeout", "1")
    assert stopped.exit_code == 1 and "stopped" in stopped.output, stopped.output

    # running it again brings the grants up to date (tables added since are readable)
    again = CliRunner().invoke(cli, ["--db", url, "db", "reader-role", "--name", name])
    assert again.exit_code == 0 and again.output.startswith(f"updated role {name}"), again.output


def test_a_reader_that_cannot_connect_is_one_line_naming_the_fix(pg, monkeypatch):
    url, _ = pg
    from sqlalchemy.engine import make_url

    monkeypatch.setenv(reader.ENV_READER_URL, make_url(url).set(username="no_such_role_here").render_as_string(False))
    r = _sql(url, "SELECT 1")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "reader role 'no_such_role_here'" in r.output and reader.ENV_READER_PASSWORD in r.output


def test_the_reader_role_is_postgresql_only(tmp_path):
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "s.db"), "init"])
    assert r.exit_code == 0
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "s.db"), "db", "reader-role"])
    assert r.exit_code == 1 and "PostgreSQL role" in r.output, r.output
