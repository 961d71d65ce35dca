"""PostgreSQL read-only `sql` refuses every VOLATILE server function outside a short list of
ones that only compute or wait (issue 41): what a rollback cannot undo — consuming a logical
replication slot, resetting pg_stat_statements, writing autoprewarm's file — is refused before
the statement runs, as the URL's role and as the reader role. A real server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.storage import reader

pytestmark = pytest.mark.postgres

QUERIES = [
    "SELECT * FROM pg_logical_slot_get_changes('slot', NULL, NULL)",
    "SELECT pg_catalog.pg_logical_slot_get_changes/**/('slot', NULL, NULL)",
    "SELECT \"pg_logical_slot_peek_changes\"('slot', NULL, NULL)",
    "SELECT pg_stat_statements_reset()",
    "SELECT autoprewarm_dump_now()",
    "SELECT nextval('episodes_id_seq')",
]


@pytest.fixture
def pg(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    import psycopg
    from pg import _libpq, fresh_database, server_url

    name = f"reader_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(reader, "READER_ROLE", name)
    monkeypatch.delenv(reader.ENV_READER_URL, raising=False)
    try:
        with fresh_database("volatile") as url:
            with psycopg.connect(_libpq(url.replace("+psycopg", "")), autocommit=True) as conn:
                for extension in ("pg_stat_statements", "pg_prewarm"):
                    conn.execute(f"CREATE EXTENSION IF NOT EXISTS {extension}")
            assert CliRunner().invoke(cli, ["--db", url, "init"]).exit_code == 0
            yield url, name
    finally:
        with psycopg.connect(_libpq(server_url()), autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{name}"')


def _refused(url: str, query: str) -> str:
    r = CliRunner().invoke(cli, ["--db", url, "sql", query])
    assert r.exit_code == 1, r.output
    (line,) = r.output.strip().splitlines()
    return line


def test_volatile_functions_are_refused_as_the_url_role_and_as_the_reader(pg, monkeypatch) -> None:
    url, name = pg
    for query in QUERIES:
        line = _refused(url, query)
        assert line.startswith("Error: read-only: ") and ("VOLATILE" in line or "side effects" in line), line
    monkeypatch.setenv("READER_TEST_PW", "pw-41")
    made = CliRunner().invoke(
        cli, ["--db", url, "db", "reader-role", "--name", name, "--password-env", "READER_TEST_PW"]
    )
    assert made.exit_code == 0, made.output
    monkeypatch.setenv(reader.ENV_READER_PASSWORD, "pw-41")
    who = CliRunner().invoke(cli, ["--db", url, "sql", "SELECT current_user AS u", "--json"])
    assert who.exit_code == 0 and name in who.output, who.output
    for query in QUERIES:
        assert "read-only: " in _refused(url, query)
    # what only computes or waits still runs (random() is VOLATILE too)
    ok = CliRunner().invoke(
        cli, ["--db", url, "sql", "SELECT random() < 2 AS r, upper('a') AS u, now() IS NOT NULL AS t"]
    )
    assert ok.exit_code == 0, ok.output
