"""The lease heartbeat outlives database errors (issue 34 item 5).

A real ``score`` process holds a lease while its request waits at the fault server; another
connection takes SQLite's write lock (``BEGIN IMMEDIATE``) and keeps it until the heartbeat
has failed twice (the busy timeout is made short through ``HCAPO_STORE_BUSY_TIMEOUT``). Once
the lock is released the heartbeat must renew the lease, and commit that renewal before the
lease it held ran out (both read from the database); then the run ends with every step
scored once. Before the fix the heartbeat task died on its first error and never renewed.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _waiting import HANG_GUARD_S, wait_until
from faultserver import FaultServer

from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.db import ENV_BUSY_TIMEOUT
from hcapo_store.storage.store import Store

HCAPO = shutil.which("hcapo-store") or str(Path(sys.executable).with_name("hcapo-store"))
# A beat every 8 s; failed beats are retried within 4 s (the first within 0.5 s, the next within
# 1 s). The renewal lands about 2 s after the beat that failed first, about 16 s before the lease
# it renews runs out: that margin is what the lease length buys (45 s gave 28 s, for 15 s more).
LEASE = "24"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[FaultServer]:
    ref = make_server(tiny_model_dir)
    with FaultServer(ref) as proxy:
        yield proxy
    ref.httpd.server_close()


def _one(path: Path, sql: str) -> object:
    with sqlite3.connect(str(path)) as conn:
        return conn.execute(sql).fetchone()[0]


@pytest.mark.slow  # waits out two failed heartbeats of a 24 s lease in a score process
def test_the_heartbeat_survives_a_held_write_lock(tmp_path, server, tiny_model_dir):
    root = tmp_path / "episodes"
    write_standard_episodes(root, 1, seed=7, steps_per_subtask=1, output_words=12)
    db = tmp_path / "store.db"
    with Store.open(str(db)) as store:
        ingest(store, [root])
    steps = _one(db, "SELECT COUNT(*) FROM steps")
    log = tmp_path / "score.err"
    server.reset()
    server.hold_answers = threading.Event()
    cmd = [HCAPO, "--db", str(db), "score", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
    cmd += ["--max-context", "2048", "--concurrency", "1", "--grouping", "per-step", "--lease-seconds", LEASE]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env={**os.environ, "NO_COLOR": "1", ENV_BUSY_TIMEOUT: "0.2"},
    )
    lock: sqlite3.Connection | None = None
    try:
        procs = {"score": proc}
        wait_until(lambda: server.requests >= 1, "the first request (its lease is committed)", procs=procs)
        # The episode's floor is written by the first flush: nothing but the heartbeat writes after it.
        wait_until(lambda: _one(db, "SELECT COUNT(*) FROM episode_floors") >= 1, "the floor is stored", procs=procs)
        held_until = _one(db, "SELECT MAX(lease_expires_at) FROM attempts WHERE status = 'leased'")
        lock = sqlite3.connect(str(db), isolation_level=None, check_same_thread=False)
        lock.execute("BEGIN IMMEDIATE")
        wait_until(lambda: "leases failed (2 time(s) in a row" in log.read_text(), "two failed heartbeats", procs=procs)
        lock.execute("ROLLBACK")
        lock.close()
        lock = None
        wait_until(
            lambda: _one(db, "SELECT MIN(lease_expires_at) FROM attempts WHERE status = 'leased'") > held_until,
            "the lease is renewed",
            procs=procs,
        )
        renewed_at = _one(db, "SELECT heartbeat_at FROM workers WHERE state = 'running'")
        assert renewed_at < held_until, (renewed_at, held_until)  # renewed while the lease still held
        server.hold_answers.set()
        assert proc.wait(timeout=HANG_GUARD_S) == 0, log.read_text()
    finally:
        server.hold_answers.set()
        server.hold_answers = None
        if lock is not None:
            lock.close()
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert "Traceback" not in err, err
    assert _one(db, "SELECT COUNT(*) FROM scores") == steps
    assert _one(db, "SELECT COUNT(*) FROM attempts WHERE status = 'done'") == steps
    assert set(server.counts.values()) == {1}, server.counts  # every request sent once: nothing scored twice
    assert server.requests == steps
