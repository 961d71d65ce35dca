"""A database deleted, dropped or replaced under a running ``follow`` (issue 41): the follower
compares the store's identity (``Store.identity``: SQLite's file, PostgreSQL's cluster,
database and tables) before and after each round, says what happened in one line and stops
non-zero, instead of reporting batches that exist nowhere or going on against an empty
database. Real SQLite, real PostgreSQL (``HCAPO_TEST_PG_URL``; skipped without it), a real
follower over real files and a real server over a tiny real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pg
import pytest
import test_follow_round4
from test_follow_round4 import _follower

from hcapo_store.devkit.refserver import ReferenceServer
from hcapo_store.errors import StoreError, StoreGone
from hcapo_store.storage.store import Store

ref = test_follow_round4.ref  # the fixture: a reference server over the tiny model, one per module

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A folder with one JSONL episode: a batch of one."""
    line = {
        "episode_id": "ep-0",
        "reward": 0.5,
        "messages": [
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "I will look."},
            {"role": "user", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ],
    }
    folder = tmp_path / "jsonl"
    folder.mkdir()
    (folder / "eps.jsonl").write_text(json.dumps(line) + "\n")
    return folder


def _admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(pg._libpq(pg.server_url()), autocommit=True) as conn:
        conn.execute(sql)


def _database(url: str) -> str:
    from sqlalchemy.engine import make_url

    return str(make_url(url).database)


def test_sqlite_identity_is_the_file_and_a_deleted_file_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store.open(str(path)) as store:
        first = store.identity()
        assert store.identity() == first  # asked twice: the same database
        other = tmp_path / "other.db"
        Store.open(str(other)).close()
        os.replace(other, path)
        assert store.identity() != first
        path.unlink()
        with pytest.raises(StoreGone, match=r"^the database .*s\.db was deleted$"):
            store.identity()


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg.fresh_database("follow_identity") as url:
        yield url


def test_postgres_identity_changes_with_the_database_and_its_tables(pg_url: str) -> None:
    name = _database(pg_url)
    with Store.open(pg_url) as store:
        first = store.identity()
        assert first[0] == "postgresql" and None not in first[2:]
        assert store.identity() == first
        # the tables dropped and migrated again: another store in the same database
        _admin(f'DROP DATABASE "{name}" WITH (FORCE)')
        with pytest.raises(
            StoreGone, match=rf'^the database .*{name} was dropped \(database "{name}" does not exist\)$'
        ):
            store.identity()
        _admin(f'CREATE DATABASE "{name}"')
        with pytest.raises(StoreGone, match=r"lost its tables \(the store's schema was dropped\)$"):
            store.identity()  # created again, empty
        Store.open(pg_url).close()  # migrated again
        again = store.identity()
        assert again[:2] == first[:2] and again[2:] != first[2:]  # same cluster, another database


@pytest.mark.parametrize("how", ["database dropped and created again", "schema dropped and migrated again"])
def test_postgres_database_replaced_under_follow_stops_it(
    pg_url: str, root: Path, ref: ReferenceServer, tiny_model_dir: Path, how: str
) -> None:
    name = _database(pg_url)
    with Store.open(pg_url) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=1)
        assert len(follower.cycle().published) == 1
        if how.startswith("database"):
            _admin(f'DROP DATABASE "{name}" WITH (FORCE)')
            _admin(f'CREATE DATABASE "{name}"')
        else:
            with store.engine.begin() as conn:
                conn.exec_driver_sql("DROP SCHEMA public CASCADE")
                conn.exec_driver_sql("CREATE SCHEMA public")
        Store.open(pg_url).close()  # a new, empty store where the old one was
        with pytest.raises(
            StoreError, match=r"was replaced by another database .* while this process used it: stopping"
        ):
            follower.cycle()


@pytest.mark.slow
def test_follow_exits_1_in_one_line_when_its_postgres_database_is_dropped(
    pg_url: str, root: Path, ref: ReferenceServer, tiny_model_dir: Path
) -> None:
    """Not a traceback, not a retry forever: the follower's next look finds the database gone."""
    argv = [sys.executable, "-m", "hcapo_store", "--db", pg_url, "follow", str(root), "--server", ref.url]
    argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--group-size", "1", "--poll", "0.1"]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("follow:")  # its first round is done
        _admin(f'DROP DATABASE "{_database(pg_url)}" WITH (FORCE)')
        assert proc.wait(timeout=300) == 1
        rest = proc.stderr.read()
        assert "Traceback" not in rest, rest
        (said,) = [line for line in rest.splitlines() if "while this process used it" in line]
        assert f'was dropped (database "{_database(pg_url)}" does not exist)' in said, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
