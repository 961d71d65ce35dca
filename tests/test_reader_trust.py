"""The PostgreSQL reader role is checked by what it can do, never trusted by its name, and every
user query runs with the store's schema pinned (issue 34 item 6). On a real server: roles made
"by someone else" (the admin connection here), with look-alike tables in their own schema."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage import reader
from hcapo_store.storage.store import Store


def _admin(url: str | None = None):
    import psycopg
    from pg import _libpq, server_url

    return psycopg.connect(_libpq(url or server_url()), autocommit=True)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str, set[str]]]:
    """A fresh store with episodes, a role name for this test only, and the stored episode names."""
    from pg import fresh_database

    name = f"reader_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(reader, "READER_ROLE", name)
    monkeypatch.delenv(reader.ENV_READER_URL, raising=False)
    write_standard_episodes(tmp_path / "episodes", 2, seed=4, steps_per_subtask=1, output_words=8)
    try:
        with fresh_database("trust") as url:
            with Store.open(url) as opened:
                ingest(opened, [tmp_path / "episodes"])
                names = {row[0] for row in opened.query("SELECT name FROM episodes")[1]}
            yield url, name, names
    finally:
        with _admin() as conn:
            conn.execute(f'DROP OWNED BY "{name}"') if _role_exists(conn, name) else None
            conn.execute(f'DROP ROLE IF EXISTS "{name}"')


def _role_exists(conn, name: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone() is not None


def _forger(url: str, name: str, *extra: str) -> None:
    """Someone else's role of the reader's name: it may read the store, and its search_path
    points at its own schema, whose `episodes` holds a forged row."""
    with _admin(url) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
        conn.execute(f'CREATE SCHEMA forged AUTHORIZATION "{name}"')
        conn.execute("CREATE TABLE forged.episodes (name text)")
        conn.execute("INSERT INTO forged.episodes VALUES ('forged-episode')")
        conn.execute(f'GRANT SELECT ON forged.episodes TO "{name}"')
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{name}"')
        conn.execute(f'ALTER ROLE "{name}" SET search_path = forged, public')
        for statement in extra:
            conn.execute(statement.format(role=f'"{name}"'))


def _sql(url: str, query: str):
    return CliRunner().invoke(cli, ["--db", url, "sql", query])


def _one_error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_a_look_alike_schema_cannot_answer_for_the_store(store):
    url, name, names = store
    _forger(url, name)
    r = _sql(url, "SELECT name FROM episodes")
    assert r.exit_code == 0, r.output
    assert "forged-episode" not in r.output, r.output
    assert all(n in r.output for n in names), r.output
    assert name in _sql(url, "SELECT current_user").output  # it does run as the reader role


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("GRANT INSERT ON public.episodes TO {role}", "may write to episodes"),
        ("ALTER ROLE {role} CREATEDB", "has CREATEDB"),
        ("GRANT pg_read_server_files TO {role}", "is a member of pg_read_server_files"),
        ("REVOKE SELECT ON public.steps FROM {role}", "may not read steps"),
    ],
)
def test_a_role_that_can_do_more_or_less_than_read_the_store_is_refused(store, extra, says):
    url, name, _ = store
    _forger(url, name, extra)
    line = _one_error(_sql(url, "SELECT count(*) FROM episodes"))
    assert says in line and repr(name) in line and "reader-role" in line, line


def test_a_reader_url_into_another_database_is_refused(store, monkeypatch):
    from pg import fresh_database

    url, name, _ = store
    with fresh_database("elsewhere") as other:
        with Store.open(other):
            pass  # a look-alike store, empty
        monkeypatch.setenv(reader.ENV_READER_URL, other)
        line = _one_error(_sql(url, "SELECT count(*) FROM episodes"))
    assert "another server or database" in line, line


def test_a_role_made_by_db_reader_role_passes_its_check(store):
    url, name, names = store
    made = CliRunner().invoke(cli, ["--db", url, "db", "reader-role", "--name", name])
    assert made.exit_code == 0, made.output
    r = _sql(url, "SELECT name FROM episodes")
    assert r.exit_code == 0 and all(n in r.output for n in names), r.output
