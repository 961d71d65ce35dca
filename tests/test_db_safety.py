"""Files that are not hcapo-store databases are refused untouched; backups are never partial."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hcapo_store.cli import cli
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import NotAStore
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(str(path)) as conn:
        return sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    path = tmp_path / "notes.db"
    with sqlite3.connect(str(path)) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO notes (body) VALUES ('keep me')")
    return path


@pytest.fixture
def unversioned(tmp_path: Path) -> Path:
    """hcapo-store's tables without an alembic_version: not something we can upgrade."""
    path = tmp_path / "unversioned.db"
    Store.open(str(path)).close()
    with sqlite3.connect(str(path)) as conn:
        conn.execute("DROP TABLE alembic_version")
    return path


@pytest.mark.parametrize(
    "args", [["db", "upgrade"], ["init"], ["status"], ["ingest", "."], ["credits", "list"], ["sql", "SELECT 1"]]
)
@pytest.mark.parametrize("kind", ["foreign", "unversioned"])
def test_commands_refuse_a_database_that_is_not_ours(kind, args, request, runner):
    path = request.getfixturevalue(kind)
    before, raw = _tables(path), path.read_bytes()
    result = runner.invoke(cli, ["--db", str(path), *args])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "is not an hcapo-store database" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert _tables(path) == before
    assert not list(path.parent.glob(f"{path.name}.bak*"))
    if kind == "foreign":  # left byte for byte: not switched to WAL, no side files
        assert path.read_bytes() == raw
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.parametrize("args", [["init"], ["status"], ["ingest", "."], ["db", "upgrade"], ["db", "current"]])
def test_another_applications_empty_database_is_left_alone(tmp_path, runner, args):
    path = tmp_path / "app.db"
    with sqlite3.connect(str(path)) as conn:
        conn.execute("PRAGMA application_id = 1234")
    raw = path.read_bytes()
    result = runner.invoke(cli, ["--db", str(path), *args])
    assert result.exit_code == 1 and "another application's empty SQLite database" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert path.read_bytes() == raw and sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_a_zero_byte_file_becomes_a_store(tmp_path, runner):
    path = tmp_path / "empty.db"
    path.touch()
    assert runner.invoke(cli, ["--db", str(path), "init"]).exit_code == 0
    assert "episodes" in _tables(path)


def test_db_current_on_a_missing_path_creates_nothing(tmp_path, runner):
    path = tmp_path / "no" / "such" / "dir" / "x.db"
    result = runner.invoke(cli, ["--db", str(path), "db", "current"])
    assert result.exit_code == 1 and "no database at" in result.output, result.output
    assert not (tmp_path / "no").exists()


def test_upgrade_of_a_future_revision_is_one_line(tmp_path, runner):
    path = tmp_path / "future.db"
    Store.open(str(path)).close()
    with sqlite3.connect(str(path)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    for args in (["db", "upgrade"], ["status"]):
        result = runner.invoke(cli, ["--db", str(path), *args])
        assert result.exit_code == 1, result.output
        assert "unknown to this hcapo-store" in result.output and len(result.output.strip().splitlines()) == 1
    assert not list(tmp_path.glob("future.db.bak*"))


def test_not_a_sqlite_file_is_one_line(tmp_path, runner):
    path = tmp_path / "readme.db"
    path.write_text("this is not a database\n" * 100)
    result = runner.invoke(cli, ["--db", str(path), "db", "upgrade"])
    assert result.exit_code == 1
    assert "is not a SQLite database" in result.output and len(result.output.strip().splitlines()) == 1
    assert path.read_text() == "this is not a database\n" * 100


def test_upgrade_database_raises_not_a_store(foreign):
    with pytest.raises(NotAStore):
        db.upgrade_database(str(foreign))
    assert _tables(foreign) == ["notes"]


KILL_DURING_BACKUP = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from sqlalchemy import event
    from hcapo_store.storage import db

    path = Path(sys.argv[1])
    engine = db.make_engine(db.resolve_url(str(path)))

    def kill_once_copying() -> int:
        # Killed while VACUUM INTO is writing: as a kill -9 of `db upgrade` would.
        if [p for p in path.parent.iterdir() if p.name != path.name and ".bak" in p.name and p.stat().st_size]:
            os.kill(os.getpid(), signal.SIGKILL)
        return 0

    @event.listens_for(engine, "connect")
    def _handler(dbapi_conn, _record):
        dbapi_conn.set_progress_handler(kill_once_copying, 50)

    db.backup(engine)
    print("backup finished without being killed")
""")


def test_killed_backup_leaves_no_file_named_like_a_backup(tmp_path):
    path = tmp_path / "store.db"
    with Store.open(str(path)) as store:
        store.query("INSERT INTO scorers (id, label, spec, created_at) VALUES ('s', 'l', '{}', 'now')", read_only=False)
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_BACKUP, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert not list(tmp_path.glob("store.db.bak*")), list(tmp_path.iterdir())
    # The next backup is complete and named like one.
    engine = db.make_engine(db.resolve_url(str(path)))
    try:
        copy = db.backup(engine)
    finally:
        engine.dispose()
    assert copy is not None and copy.name.startswith("store.db.bak-")
    assert not list(tmp_path.glob(".store.db.bak-*.partial-*"))  # the killed copy's partial file is cleaned
    with sqlite3.connect(str(copy)) as conn:
        assert conn.execute("SELECT label FROM scorers").fetchall() == [("l",)]


@pytest.mark.parametrize(
    "url", ["postgresql://user:s3cret@host:notaport/db", "postgresql://[::1", "postgres://u:s3cret@h:99999999999/x"]
)
def test_a_malformed_postgresql_url_is_one_line_with_its_password_masked(url, runner):
    result = runner.invoke(cli, ["--db", url, "status"])
    assert result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit))
    assert "Error: " in result.output and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "s3cret" not in result.output


def test_a_new_database_in_a_missing_folder_is_refused_in_one_line(tmp_path, runner):
    """As ``sqlite3`` does: a typo in the folder is not silently made into a new tree (issue 41)."""
    episodes = tmp_path / "eps"
    write_standard_episodes(episodes, 1)
    path = tmp_path / "nonexistent" / "dir" / "h.db"
    for args in (["ingest", str(episodes)], ["init"]):
        result = runner.invoke(cli, ["--db", str(path), *args])
        assert result.exit_code == 1, result.output
        (line,) = result.output.strip().splitlines()
        assert f"the folder {path.parent} does not exist" in line, line
    assert not (tmp_path / "nonexistent").exists()
