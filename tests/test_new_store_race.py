"""Processes that open a new SQLite store together all succeed (issue 34 item 7), and a lock
error says what happened: a lock held past the busy timeout, or SQLite giving up at once.

Real processes (`hcapo-store ingest`, as the README invites running two), a real file, the
real migrations; the immediate BUSY is a real WAL snapshot conflict between two connections.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import HANG_GUARD_S
from sqlalchemy import event, text

from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import DatabaseLocked
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

HCAPO = shutil.which("hcapo-store") or str(Path(sys.executable).with_name("hcapo-store"))
ROUNDS = 3  # each a new file; the race is not forced, so it is run a few times


@pytest.fixture(scope="module")
def episodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("race-episodes")
    write_standard_episodes(root, 2, seed=2, steps_per_subtask=1, output_words=8)
    return root


def test_two_ingests_started_together_on_a_new_file_both_succeed(tmp_path, episodes):
    for n in range(ROUNDS):
        path = tmp_path / f"new{n}.db"
        procs = [
            subprocess.Popen(
                [HCAPO, "--db", str(path), "ingest", str(episodes)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "NO_COLOR": "1"},
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, (n, out, err)
            assert "Traceback" not in err and "Error" not in err, err
        with sqlite3.connect(str(path)) as conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(db.head_revision(),)]
            assert conn.execute("SELECT COUNT(*) FROM episodes WHERE is_current").fetchone()[0] == 2


def test_an_immediate_busy_is_not_called_a_lock_held_for_the_busy_timeout(tmp_path):
    """A transaction that read, then wants to write after another process wrote, gets SQLITE_BUSY
    at once: the message says so, not "held its write lock longer than 60s"."""
    path = tmp_path / "busy.db"
    Store.open(str(path)).close()
    engine = db.make_engine(db.resolve_url(str(path)))
    other = sqlite3.connect(str(path), isolation_level=None)
    try:
        with pytest.raises(DatabaseLocked) as caught, db.read(engine) as conn, conn.begin():
            conn.execute(text("SELECT COUNT(*) FROM episodes")).scalar()  # this snapshot is now pinned
            other.execute("BEGIN IMMEDIATE")
            other.execute(
                "INSERT INTO workers (id, scorer_id, host, pid, started_at, heartbeat_at, state, scored, failed) "
                "VALUES ('w', 's', 'h', 1, 0, 0, 'x', 0, 0)"
            )
            other.execute("COMMIT")
            conn.execute(text("DELETE FROM workers"))  # a write on a stale snapshot: BUSY at once
    finally:
        other.close()
        engine.dispose()
    message = str(caught.value)
    assert "is busy" in message and "at the same moment" in message, message
    assert "longer than" not in message, message


def test_a_migration_committed_between_two_schema_reads_is_not_taken_for_an_old_schema(tmp_path):
    """The race CI once lost (1 round in 3): process B read "no revision" just before process A
    committed the first migration, then read A's tables, and refused the store as behind head.
    Here A's whole migration commits right after B's first schema read, every time; B must see
    one consistent state (a blank file), wait for the lock and find the head."""
    path = tmp_path / "straddle.db"
    url = db.resolve_url(str(path))
    db.preflight(url, create=True)
    other = db.make_engine(url)  # process A's engine
    engine = db.make_engine(url)  # process B's engine
    fired: list[str] = []

    @event.listens_for(engine, "after_cursor_execute")
    def _migrate_elsewhere(_conn, _cursor, statement, *_args) -> None:
        if not fired and not statement.lstrip().upper().startswith("BEGIN"):
            fired.append(statement)
            db.upgrade(other)  # A migrates and commits between B's reads

    try:
        db.check_schema(engine, create=True)
        assert fired, "the hook never ran: the test did not interleave anything"
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()
        other.dispose()
